"""The KV connector seam: KV that comes from, or goes to, somewhere other than this pool.

A connector has two sides, because the engine is split the same way:

* the **scheduler side** lives with the scheduler (torch-free, in the engine core). It tells
  the scheduler how many more prompt tokens it can supply for a request beyond the local
  prefix cache, and whether it loads them asynchronously (the request then waits in
  `WAITING_FOR_REMOTE_KV` with its blocks allocated while the engine steps the others); it
  hears which blocks were allocated for them; it decides whether a finished request's blocks
  are held (under a lease, for someone to read) and what its response says about them; and
  each step it writes plain metadata for its worker side.
* the **worker side** lives with each rank's model runner and owns the data path: it starts
  loads, makes a step wait for what the step needs, saves, and reports which loads finished
  or failed and which holds may end.

Timing contract: the worker side handles a step's metadata before that step's forward pass,
and the scheduler never gives a request's blocks to another request while the worker side
may still write them, except through a `cancel` that the next metadata carries (a load
cancelled that way never writes after its cancel was handled). A load that fails, or that
does not finish by the scheduler side's deadline, makes the request compute its prompt here.

Several connectors can be chained (`MultiConnector*`): the first that offers tokens for a
request loads them; every connector sees finished requests. Concrete connectors: the
prefill/decode handoff (`pd.py`); the KV tiers (CPU, disk, cluster store) plug in the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.types import Request


@dataclass
class KVConnectorOutput:
    """The worker sides' report of asynchronous KV work, per step."""

    finished_loads: set[str] = field(default_factory=set)  # request ids whose KV arrived
    failed_loads: set[str] = field(default_factory=set)  # request ids whose load failed: compute instead
    finished_holds: set[str] = field(default_factory=set)  # hold ids whose blocks may be freed
    counters: dict[str, float] = field(default_factory=dict)  # cumulative, for /load
    # Anything else a connector's worker side tells its scheduler side, under its name
    # (e.g. the KV tiers: chunks stored, writes dropped, load timings).
    reports: dict[str, Any] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.finished_loads or self.failed_loads or self.finished_holds or self.reports)


@dataclass(frozen=True)
class HoldDecision:
    """What `request_finished` decides for a request's blocks."""

    num_blocks: int = 0  # leading blocks to keep referenced after the request ends
    hold_id: str | None = None  # reported in `finished_holds` when they may be freed
    kv_transfer_params: dict[str, Any] | None = None  # what the response tells the caller


NO_HOLD = HoldDecision()


@dataclass(frozen=True)
class KVCacheAccess:
    """A worker's KV cache as connectors see it (data movers on the worker side).

    `read_blocks(ids)` / `write_blocks(ids, data)` copy whole blocks (every layer, K and V);
    `layout` is tandem.kvcache.transfer.base.KVLayout; `shm_path` is set when the cache lives
    in a shared-memory file other processes on this host may map.
    """

    read_blocks: Any
    write_blocks: Any
    layout: Any
    num_blocks: int
    rank: int = 0
    world_size: int = 1
    shm_path: str | None = None
    fingerprint: str = ""  # the model's (tandem/loader/fingerprint.py), for stored KV's headers


class KVConnectorScheduler(ABC):
    """The scheduler side. Every method runs on the engine core's thread."""

    name = "connector"
    # The EngineConfig section that configures this connector; its counters are reported under
    # this key (`EngineLoad.connectors`, /load, /metrics). connector/factory.py checks it matches
    # the section the connector was registered with.
    section = "connector"

    def set_worker_info(self, infos: Sequence[dict[str, Any]]) -> None:  # noqa: B027 - optional hook
        """What each rank's worker side reported when its KV cache was registered."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool] | None:
        """Tokens beyond `num_computed_tokens` (the local prefix hit) this connector can supply,
        and whether it loads them asynchronously. None: cannot tell yet, ask again next step
        (e.g. another request is loading the same blocks). Called until the request is
        admitted or starts loading; must not count anything twice."""

    def update_state_after_alloc(self, request: Request, block_ids: list[int],  # noqa: B027
                                 num_external_tokens: int) -> None:
        """Blocks are allocated: `block_ids` are all the request's blocks; the external tokens
        start at the request's `num_computed_tokens`."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """This step's instructions for the worker side (plain, picklable), or None.

        `scheduler_output` is the step's SchedulerOutput (tandem/batch/scheduler_output.py), so a
        connector that saves KV knows which requests compute which tokens this step."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:  # noqa: B027
        """The worker sides' report for the step that just ran."""

    def request_finished(self, request: Request, block_ids: list[int]) -> HoldDecision:
        """A request ended (any reason, aborts included): hold some of its blocks?"""
        return NO_HOLD

    def release(self, hold_id: str) -> None:  # noqa: B027
        """Someone outside decided a hold may end now (nobody will read it)."""

    def timed_out_loads(self, now: float) -> list[str]:
        """Loads to give up on now (the scheduler computes their prompts instead)."""
        return []

    def pending_work(self) -> float | None:
        """Seconds until the worker side should be polled again, or None if nothing is pending."""
        return None

    def counters(self) -> dict[str, Any]:
        """This connector's cumulative counters. A `held` entry, if any, counts KV kept leased
        to someone else: a draining worker waits until no connector holds any."""
        return {}

    def counters_by_section(self) -> dict[str, dict[str, Any]]:
        """Every connector's counters under its own section (a chain reports each of its own)."""
        return {self.section: self.counters()}

    def endpoints(self) -> dict[str, str]:
        """Addresses this worker offers other workers (e.g. "kv_source"), for /load and routers."""
        return {}

    def drain_events(self) -> list[tuple[str, int, str]]:
        """KV events beyond the device pool's, in order: ("stored" | "removed", block hash,
        medium), e.g. blocks that entered or left a CPU, disk or cluster tier."""
        return []


class KVConnectorWorker(ABC):
    """The worker side. Runs in each rank's worker, around the model runner."""

    name = "connector"

    def register_kv_cache(self, kv: KVCacheAccess) -> dict[str, Any]:
        """Start with this rank's cache; return what the scheduler side needs to know."""
        return {}

    @abstractmethod
    def start_load_kv(self, metadata: Any) -> None:
        """Apply a step's metadata, before its forward pass (start loads, cancel, hold, release)."""

    def wait_for_load(self) -> None:  # noqa: B027 - optional hook
        """Block until the KV this step's forward reads is in place (synchronous loads)."""

    def save_kv(self, metadata: Any) -> None:  # noqa: B027 - optional hook
        """After the forward: start saving what this step computed and the metadata names."""

    def wait_for_save(self) -> None:  # noqa: B027 - optional hook
        """Before the step returns: make sure what must be saved by now is saved."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Loads and holds that completed since the last call, plus cumulative counters."""

    def shutdown(self) -> None:  # noqa: B027
        pass


class MultiConnectorScheduler(KVConnectorScheduler):
    """Several connectors in a chain; the first that offers tokens for a request loads them."""

    name = "multi"

    def __init__(self, connectors: list[KVConnectorScheduler]) -> None:
        self.connectors = connectors
        self._chosen: dict[str, int] = {}
        self._composites: dict[str, set[str]] = {}  # hold id -> the connectors' holds left in it

    def set_worker_info(self, infos: Sequence[dict[str, Any]]) -> None:
        for index, connector in enumerate(self.connectors):
            connector.set_worker_info([info.get(str(index), {}) for info in infos])

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool] | None:
        for index, connector in enumerate(self.connectors):
            offer = connector.get_num_new_matched_tokens(request, num_computed_tokens)
            if offer is None:
                return None
            if offer[0] > 0:
                self._chosen[request.request_id] = index
                return offer
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        index = self._chosen.get(request.request_id)
        if index is not None:
            self.connectors[index].update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        metas = [c.build_connector_meta(scheduler_output) for c in self.connectors]
        return None if all(m is None for m in metas) else metas

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for connector in self.connectors:
            connector.update_connector_output(output)
        for composite, parts in list(self._composites.items()):
            parts -= output.finished_holds
            if not parts:
                del self._composites[composite]
                output.finished_holds.add(composite)

    def request_finished(self, request: Request, block_ids: list[int]) -> HoldDecision:
        """Every connector decides; when several hold the request's blocks (a prefill worker's
        handoff lease and its KV tiers' copy), the blocks stay held, as many as the largest
        asks, under one composite hold that ends when all of theirs have."""
        self._chosen.pop(request.request_id, None)
        decisions = [c.request_finished(request, block_ids) for c in self.connectors]
        holding = [d for d in decisions if d.num_blocks]
        params: dict[str, Any] = {}
        for decision in decisions:
            params.update(decision.kv_transfer_params or {})
        if len(holding) <= 1:
            chosen = holding[0] if holding else NO_HOLD
            return HoldDecision(chosen.num_blocks, chosen.hold_id, params or None)
        parts = {d.hold_id for d in holding if d.hold_id is not None}
        composite = "+".join(sorted(parts))
        self._composites[composite] = parts
        return HoldDecision(max(d.num_blocks for d in holding), composite, params or None)

    def release(self, hold_id: str) -> None:
        for part in self._composites.get(hold_id, {hold_id}):
            for connector in self.connectors:
                connector.release(part)

    def timed_out_loads(self, now: float) -> list[str]:
        return [r for c in self.connectors for r in c.timed_out_loads(now)]

    def pending_work(self) -> float | None:
        waits = [w for w in (c.pending_work() for c in self.connectors) if w is not None]
        return min(waits) if waits else None

    def counters_by_section(self) -> dict[str, dict[str, Any]]:
        merged: dict[str, dict[str, Any]] = {}
        for connector in self.connectors:
            merged.update(connector.counters_by_section())
        return merged

    def endpoints(self) -> dict[str, str]:
        merged: dict[str, str] = {}
        for connector in self.connectors:
            merged.update(connector.endpoints())
        return merged

    def drain_events(self) -> list[tuple[str, int, str]]:
        return [event for connector in self.connectors for event in connector.drain_events()]


class MultiConnectorWorker(KVConnectorWorker):
    name = "multi"

    def __init__(self, connectors: list[KVConnectorWorker]) -> None:
        self.connectors = connectors

    def register_kv_cache(self, kv: KVCacheAccess) -> dict[str, Any]:
        return {str(i): c.register_kv_cache(kv) for i, c in enumerate(self.connectors)}

    def start_load_kv(self, metadata: Any) -> None:
        for connector, meta in zip(self.connectors, metadata or [None] * len(self.connectors), strict=True):
            connector.start_load_kv(meta)

    def wait_for_load(self) -> None:
        for connector in self.connectors:
            connector.wait_for_load()

    def save_kv(self, metadata: Any) -> None:
        for connector, meta in zip(self.connectors, metadata or [None] * len(self.connectors), strict=True):
            connector.save_kv(meta)

    def wait_for_save(self) -> None:
        for connector in self.connectors:
            connector.wait_for_save()

    def get_finished(self) -> KVConnectorOutput:
        merged = KVConnectorOutput()
        for connector in self.connectors:
            out = connector.get_finished()
            merged.finished_loads |= out.finished_loads
            merged.failed_loads |= out.failed_loads
            merged.finished_holds |= out.finished_holds
            merged.counters.update(out.counters)
            merged.reports.update(out.reports)
        return merged

    def shutdown(self) -> None:
        for connector in self.connectors:
            connector.shutdown()


class KVOutputAggregator:
    """Merges the ranks' connector reports: a load or hold is done when every rank says so.

    Each rank moves its own KV (with tensor parallelism, its own shard), so a request's load
    is finished only once all ranks finished it, and failed if any rank failed it; counters
    and reports come from rank 0, the output rank.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._loads: dict[str, tuple[int, bool]] = {}  # request id -> (ranks reported, any failed)
        self._holds: dict[str, int] = {}

    def aggregate(self, outputs: Sequence[KVConnectorOutput]) -> KVConnectorOutput:
        if self.world_size == 1:
            return outputs[0]
        merged = KVConnectorOutput(counters=dict(outputs[0].counters), reports=dict(outputs[0].reports))
        for out in outputs:
            for request_id, failed in [(r, False) for r in out.finished_loads] + [(r, True) for r in out.failed_loads]:
                count, any_failed = self._loads.get(request_id, (0, False))
                count, any_failed = count + 1, any_failed or failed
                if count == self.world_size:
                    self._loads.pop(request_id, None)
                    (merged.failed_loads if any_failed else merged.finished_loads).add(request_id)
                else:
                    self._loads[request_id] = (count, any_failed)
            for hold_id in out.finished_holds:
                count = self._holds.get(hold_id, 0) + 1
                if count == self.world_size:
                    self._holds.pop(hold_id, None)
                    merged.finished_holds.add(hold_id)
                else:
                    self._holds[hold_id] = count
        return merged
