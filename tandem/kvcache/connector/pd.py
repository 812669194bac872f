"""The prefill/decode handoff as a KV connector (tcp and shm transports).

Prefill side (`kv_transfer_params: {"do_remote_decode": true}`): when the request ends after
its first token, `request_finished` holds the prompt's full blocks under a **lease** (an id
and an expiry) and answers with a handle (where to fetch, the blocks' chain hashes, the lease
id as `transfer_id`). The worker side's `KVSource` serves the blocks until the decode worker
releases the lease or it expires; only then are the blocks freed. Reads after the end of a
lease are refused.

Decode side (`kv_transfer_params: {"do_remote_prefill": true, <handle>}`): the blocks whose
hashes match this request's own chain and are not already in the local prefix cache are
loaded asynchronously into blocks allocated for them; the request waits in
WAITING_FOR_REMOTE_KV meanwhile. A load that fails, is refused or times out makes the
request compute its prompt here; a request that wants blocks another request is loading right
now waits for that load and then finds them in the prefix cache. After the load, the source's
lease is released.

See tandem/kvcache/transfer/ for the handle, the transports and the wire format.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem.config import KVTransferConfig
from tandem.kvcache.connector.base import (
    NO_HOLD,
    HoldDecision,
    KVCacheAccess,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from tandem.kvcache.transfer.base import KVTransferError, KVTransferHandle
from tandem.types import Request, RequestStatus

logger = logging.getLogger(__name__)

_LOAD_GRACE_S = 5.0  # beyond the fetch timeout, before the scheduler gives up on a load itself
_LOAD_POLL_S = 0.005
_HOLD_POLL_S = 0.05


# --- the per-step metadata, scheduler side -> worker side ------------------------------------
@dataclass
class LoadSpec:
    request_id: str
    handle: dict[str, Any]
    indices: list[int]  # handle block indices to fetch
    dest_block_ids: list[int]


@dataclass
class HoldSpec:
    lease_id: str
    block_ids: list[int]
    block_hashes: list[int]
    timeout: float


@dataclass
class PDMetadata:
    loads: list[LoadSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # request ids whose load must stop writing
    holds: list[HoldSpec] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)  # lease ids nobody will read
    remote_releases: list[dict[str, Any]] = field(default_factory=list)  # handles we are done with

    @property
    def empty(self) -> bool:
        return not (self.loads or self.cancels or self.holds or self.releases or self.remote_releases)


# --- scheduler side ------------------------------------------------------------------
@dataclass
class _Decision:
    handle: KVTransferHandle | None
    usable_blocks: int = 0  # leading handle blocks whose hashes equal ours
    released: bool = False


@dataclass
class _Load:
    handle: KVTransferHandle
    hashes: list[int]
    deadline: float


@dataclass
class PDCounters:
    held: int = 0  # prefill side: leases alive now
    blocks_sent: int = 0
    bytes_sent: int = 0  # over tcp, after the codec (kvcache/codec.py)
    pulls: int = 0  # decode side: requests that arrived with a handle
    blocks_received: int = 0
    bytes_received: int = 0
    blocks_already_cached: int = 0
    pull_failures: int = 0  # ... that computed their prompt here instead
    pull_seconds: float = 0.0


class PDConnectorScheduler(KVConnectorScheduler):
    name = "pd"
    section = "kv_transfer"

    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self._source: dict[str, Any] | None = None  # rank 0's KV source address and layout
        self._decided: dict[str, _Decision] = {}
        self._loads: dict[str, _Load] = {}
        self._inflight: dict[int, str] = {}  # block hash being loaded -> request id
        self._holds: set[str] = set()
        self._meta = PDMetadata()
        self._counters = PDCounters()
        self._worker_counters: dict[str, float] = {}

    def set_worker_info(self, infos: Sequence[dict[str, Any]]) -> None:
        self._source = infos[0] if infos and infos[0].get("port") else None

    # --- decode side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool] | None:
        params = request.kv_transfer_params or {}
        if (not params.get("do_remote_prefill") or not params.get("transfer_id") or not self.config.fetches_kv
                or not self.config.secret):
            return 0, False
        decision = self._decided.get(request.request_id)
        if decision is None:
            decision = self._decide(request, params)
            self._decided[request.request_id] = decision
        if decision.handle is None:
            return 0, False
        local = num_computed_tokens // self.block_size
        if local >= decision.usable_blocks:
            if not decision.released:
                self._counters.blocks_already_cached += decision.usable_blocks
                self._release_remote(decision)
            return 0, False
        wanted = request.block_hashes[local : decision.usable_blocks]
        if any(h in self._inflight for h in wanted):
            return None  # another request is loading these: take them from the prefix cache after
        return len(wanted) * self.block_size, True

    def _decide(self, request: Request, params: dict[str, Any]) -> _Decision:
        self._counters.pulls += 1
        try:
            handle = KVTransferHandle.from_json(params)
        except KVTransferError as exc:
            logger.warning("request %s: %s; computing its prompt here", request.request_id, exc)
            self._counters.pull_failures += 1
            return _Decision(None)
        ours = request.block_hashes
        usable = 0
        limit = min(len(ours), handle.num_blocks, (request.num_tokens - 1) // self.block_size)
        while usable < limit and ours[usable] == handle.block_hashes[usable]:
            usable += 1
        if usable < handle.num_blocks:
            logger.warning("request %s: only %d of %d transferred block hashes match ours (another model, "
                           "revision, cache salt or block size?); computing the rest here",
                           request.request_id, usable, handle.num_blocks)
        return _Decision(handle, usable)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        decision = self._decided[request.request_id]
        assert decision.handle is not None
        local = request.num_computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        self._counters.blocks_already_cached += local
        hashes = request.block_hashes[local : local + count]
        deadline = time.monotonic() + self.config.fetch_timeout + _LOAD_GRACE_S
        self._loads[request.request_id] = _Load(decision.handle, hashes, deadline)
        for block_hash in hashes:
            self._inflight[block_hash] = request.request_id
        self._meta.loads.append(LoadSpec(request.request_id, decision.handle.to_json(),
                                         list(range(local, local + count)), block_ids[local : local + count]))

    def _end_load(self, request_id: str, cancel: bool) -> _Load | None:
        load = self._loads.pop(request_id, None)
        if load is None:
            return None
        for block_hash in load.hashes:
            if self._inflight.get(block_hash) == request_id:
                del self._inflight[block_hash]
        if cancel:
            self._meta.cancels.append(request_id)
        decision = self._decided.get(request_id)
        if decision is not None:
            self._release_remote(decision)
        else:
            self._meta.remote_releases.append(load.handle.to_json())
        return load

    def _release_remote(self, decision: _Decision) -> None:
        if decision.handle is not None and not decision.released:
            decision.released = True
            self._meta.remote_releases.append(decision.handle.to_json())

    def timed_out_loads(self, now: float) -> list[str]:
        late = [request_id for request_id, load in self._loads.items() if load.deadline < now]
        for request_id in late:
            logger.warning("request %s: its KV did not arrive in time; computing its prompt here", request_id)
            self._counters.pull_failures += 1
            self._end_load(request_id, cancel=True)
        return late

    # --- both sides -----------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any = None) -> PDMetadata | None:
        meta, self._meta = self._meta, PDMetadata()
        return None if meta.empty else meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._worker_counters = output.counters or self._worker_counters
        for request_id in output.finished_loads:
            self._end_load(request_id, cancel=False)
        for request_id in output.failed_loads:
            if self._end_load(request_id, cancel=False) is not None:
                self._counters.pull_failures += 1
        self._holds -= output.finished_holds

    def request_finished(self, request: Request, block_ids: list[int]) -> HoldDecision:
        request_id = request.request_id
        if request_id in self._loads:  # ended (aborted) while its KV was arriving
            self._end_load(request_id, cancel=True)
        decision = self._decided.pop(request_id, None)
        if decision is not None:
            self._release_remote(decision)
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or request.status == RequestStatus.FINISHED_ABORTED:
            return NO_HOLD
        if self._source is None:
            return NO_HOLD  # this worker serves no KV (--role decode)
        num_full = min(len(block_ids), request.num_prompt_tokens // self.block_size)
        if num_full == 0:
            return NO_HOLD
        lease_id = f"{request_id}-{uuid.uuid4().hex[:12]}"
        hashes = request.block_hashes[:num_full]
        timeout = self.config.hold_timeout
        self._holds.add(lease_id)
        self._meta.holds.append(HoldSpec(lease_id, block_ids[:num_full], hashes, timeout))
        source = self._source
        handle = KVTransferHandle(lease_id, source["host"], source["port"], list(hashes), timeout)
        return HoldDecision(num_full, lease_id, handle.to_json())

    def release(self, hold_id: str) -> None:
        if hold_id in self._holds:
            self._meta.releases.append(hold_id)

    def pending_work(self) -> float | None:
        if not self._meta.empty:
            return 0.0
        if self._loads:
            return _LOAD_POLL_S
        if self._holds:
            return _HOLD_POLL_S
        return None

    def endpoints(self) -> dict[str, str]:
        source = self._source
        return {"kv_source": f"tcp://{source['host']}:{source['port']}"} if source else {}

    def counters(self) -> dict[str, float]:
        counters = asdict(self._counters)
        counters["held"] = len(self._holds)
        for name in ("blocks_sent", "blocks_received", "bytes_sent", "bytes_received", "pull_seconds"):
            counters[name] = self._worker_counters.get(name, 0)
        # what one prompt token's KV (every layer) took on the way: the codec's saving
        for side in ("sent", "received"):
            tokens = counters[f"blocks_{side}"] * self.block_size
            counters[f"bytes_per_token_{side}"] = counters[f"bytes_{side}"] / tokens if tokens else 0.0
        return counters


# --- worker side -----------------------------------------------------------------------
class PDConnectorWorker(KVConnectorWorker):
    name = "pd"

    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        self.source: Any = None
        self.sink: Any = None
        self.rank = 0
        self._holds_done: set[str] = set()  # ranks without a source end every hold at once
        self._counters = {"blocks_sent": 0.0, "blocks_received": 0.0, "bytes_sent": 0.0, "bytes_received": 0.0,
                          "pull_seconds": 0.0}

    def register_kv_cache(self, kv: KVCacheAccess) -> dict[str, Any]:
        from tandem.kvcache.transfer.sink import KVSink
        from tandem.kvcache.transfer.source import KVSource

        self.rank = kv.rank
        info: dict[str, Any] = {}
        secret = self.config.secret
        if secret is None:
            return info  # no cluster secret, no handoff: nothing listens, nothing is fetched
        if self.config.serves_kv and kv.rank == 0:
            self.source = KVSource(kv.read_blocks, kv.layout, secret, self.config.host, self.config.port,
                                   kv.shm_path, kv.num_blocks)
            info = {"host": self.source.host, "port": self.source.port}
        if self.config.fetches_kv:
            self.sink = KVSink(kv.write_blocks, kv.layout, secret, self.config.fetch_timeout,
                               codec=self.config.transfer_codec)
        return info

    def start_load_kv(self, metadata: Any) -> None:
        if not isinstance(metadata, PDMetadata):
            return
        from tandem.kvcache.transfer.sink import PullJob

        for request_id in metadata.cancels:
            if self.sink is not None:
                self.sink.cancel(request_id)
        for hold in metadata.holds:
            if self.source is not None:
                self.source.hold(hold.lease_id, hold.block_ids, hold.block_hashes, hold.timeout)
            else:
                self._holds_done.add(hold.lease_id)
        for lease_id in metadata.releases:
            if self.source is not None:
                self.source.release(lease_id)
        for load in metadata.loads:
            if self.sink is not None:
                self.sink.submit(PullJob(load.request_id, KVTransferHandle.from_json(load.handle), load.indices,
                                         load.dest_block_ids))
        for handle in metadata.remote_releases:
            if self.sink is not None and self.rank == 0:
                self.sink.release_remote(KVTransferHandle.from_json(handle))

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        if self.sink is not None:
            for result in self.sink.results():
                self._counters["pull_seconds"] += result.seconds
                if result.ok:
                    out.finished_loads.add(result.job.request_id)
                    self._counters["blocks_received"] += len(result.job.indices)
                    self._counters["bytes_received"] += result.nbytes
                else:
                    out.failed_loads.add(result.job.request_id)
                    if self.rank == 0:
                        logger.warning("request %s: KV fetch failed (%s); computing its prompt here",
                                       result.job.request_id, result.error)
        if self.source is not None:
            out.finished_holds.update(self.source.finished())
            self._counters["blocks_sent"] = self.source.blocks_sent
            self._counters["bytes_sent"] = self.source.bytes_sent
        out.finished_holds |= self._holds_done
        self._holds_done = set()
        out.counters = dict(self._counters)
        return out

    def shutdown(self) -> None:
        for part in (self.source, self.sink):
            if part is not None:
                part.close()
        self.source = self.sink = None
