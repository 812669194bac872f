"""The KV connector contract, from the scheduler's side, with a fake connector.

The fake's "remote store" maps block hashes to tokens. Its worker side writes a loaded block's
tokens into the fake model's KV memory (tests/engine/conftest.py), so a load that lands in the
wrong blocks, too late, or not at all changes what the model reads back and fails the test,
and every step checks block ownership against reference counts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from tandem.kvcache.block_hash import block_hashes, root_hash
from tandem.kvcache.connector.base import (
    NO_HOLD,
    HoldDecision,
    KVConnectorOutput,
    KVConnectorScheduler,
)
from tandem.types import Request, RequestStatus

B = 4  # conftest.BLOCK_SIZE
EOS = 2  # conftest.EOS
ROOT = root_hash("test-model", "float32", B)  # conftest.ROOT


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [10 + seed % 80] + [rng.randrange(10, 90) for _ in range(n - 1)]


@dataclass
class LoadSpec:
    request_id: str
    start: int  # first position the load fills
    tokens: list[int]
    block_ids: list[int]  # all the request's blocks
    steps_left: int
    fail: bool = False


@dataclass
class Meta:
    loads: list[LoadSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    holds: list[tuple[str, list[int], int]] = field(default_factory=list)  # (hold id, block ids, lifetime)


class FakeScheduler(KVConnectorScheduler):
    """Offers whatever leading blocks of a request the store holds."""

    def __init__(self, store: dict[int, tuple[int, ...]], load_async: bool = True, delay: int = 2,
                 fail: set[str] = frozenset(), deadline_steps: int | None = None, hold_steps: int | None = None,
                 wait_for_inflight: bool = True) -> None:
        self.store = store
        self.load_async = load_async
        self.delay = delay
        self.fail = fail
        self.deadline_steps = deadline_steps
        self.hold_steps = hold_steps
        self.wait_for_inflight = wait_for_inflight
        self.meta = Meta()
        self.loading: dict[str, list[int]] = {}  # request id -> block hashes in flight
        self.steps = 0
        self.started: dict[str, int] = {}
        self.loads_started = 0
        self.finished_requests: list[str] = []
        self.holding: set[str] = set()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool] | None:
        local = num_computed_tokens // B
        hashes = request.block_hashes[local : (request.num_tokens - 1) // B]
        count = 0
        for block_hash in hashes:
            if block_hash not in self.store:
                break
            count += 1
        inflight = {h for hs in self.loading.values() for h in hs}
        if self.wait_for_inflight and any(h in inflight for h in hashes[:count]):
            return None
        return count * B, self.load_async

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        start = request.num_computed_tokens
        hashes = request.block_hashes[start // B : (start + num_external_tokens) // B]
        tokens = [t for h in hashes for t in self.store[h]]
        self.loading[request.request_id] = hashes
        self.started[request.request_id] = self.steps
        self.loads_started += 1
        self.meta.loads.append(LoadSpec(request.request_id, start, tokens, list(block_ids),
                                        self.delay if self.load_async else 0, request.request_id in self.fail))

    def build_connector_meta(self, scheduler_output: Any) -> Meta:
        self.steps += 1
        meta, self.meta = self.meta, Meta()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for request_id in output.finished_loads | output.failed_loads:
            self.loading.pop(request_id, None)
        self.holding -= output.finished_holds

    def request_finished(self, request: Request, block_ids: list[int]) -> HoldDecision:
        self.finished_requests.append(request.request_id)
        if self.loading.pop(request.request_id, None) is not None:
            self.meta.cancels.append(request.request_id)
        if self.hold_steps is None or request.status == RequestStatus.FINISHED_ABORTED:
            return NO_HOLD
        count = request.num_prompt_tokens // B
        hold_id = f"lease-{request.request_id}"
        self.holding.add(hold_id)
        self.meta.holds.append((hold_id, block_ids[:count], self.hold_steps))
        return HoldDecision(count, hold_id, {"lease": hold_id})

    def timed_out_loads(self, now: float) -> list[str]:
        if self.deadline_steps is None:
            return []
        late = [r for r, s in self.started.items() if r in self.loading and self.steps - s >= self.deadline_steps]
        for request_id in late:
            self.loading.pop(request_id)
            self.meta.cancels.append(request_id)
        return late

    def pending_work(self) -> float | None:
        return 0.0 if self.loading or self.holding else None


class FakeWorker:
    """Writes loads into the fake model's KV memory when they are due; serves leased blocks."""

    def __init__(self, model: Any, never_finish: bool = False) -> None:
        self.model = model
        self.never_finish = never_finish
        self.pending: list[LoadSpec] = []
        self.done = KVConnectorOutput()
        self.cancelled: set[str] = set()
        self.leases: dict[str, tuple[list[int], int]] = {}  # hold id -> (block ids, steps left)
        self.reads: list[tuple[str, list[int] | None]] = []

    def start_load_kv(self, meta: Meta | None) -> None:
        if meta is None:
            return
        for request_id in meta.cancels:  # before anything runs: no write after a cancel
            self.cancelled.add(request_id)
            self.pending = [p for p in self.pending if p.request_id != request_id]
        for hold_id, block_ids, lifetime in meta.holds:
            self.leases[hold_id] = (block_ids, lifetime)
        for load in meta.loads:
            self.pending.append(load)
        for load in list(self.pending):
            if load.steps_left == 0 and not self.never_finish:
                self._complete(load)

    def _complete(self, load: LoadSpec) -> None:
        self.pending.remove(load)
        tokens = [999] * len(load.tokens) if load.fail else load.tokens  # a failed load leaves garbage
        self.model.write(load.block_ids, load.start, tokens)
        (self.done.failed_loads if load.fail else self.done.finished_loads).add(load.request_id)

    def read(self, hold_id: str) -> list[int] | None:
        """A remote reader: the leased blocks' tokens, or None once the lease ended."""
        lease = self.leases.get(hold_id)
        if lease is None:
            return None
        return [t for b in lease[0] for t in self.model.memory[b]]

    def get_finished(self) -> KVConnectorOutput:
        for load in self.pending:
            load.steps_left -= 1
        for hold_id, (block_ids, left) in list(self.leases.items()):
            if left <= 1:
                del self.leases[hold_id]
                self.done.finished_holds.add(hold_id)
            else:
                self.leases[hold_id] = (block_ids, left - 1)
        done, self.done = self.done, KVConnectorOutput()
        return done


def store_for(tokens: list[int], num_blocks: int) -> dict[int, tuple[int, ...]]:
    """The remote store holding the first `num_blocks` blocks of these tokens."""
    hashes = block_hashes(tokens[: num_blocks * B], B, ROOT)
    return {h: tuple(tokens[i * B : (i + 1) * B]) for i, h in enumerate(hashes)}


def test_async_load_completes_steps_later_while_others_step(make_engine, reference) -> None:
    p = prompt(21)
    connector = FakeScheduler(store_for(p, 5), delay=3)
    eng = make_engine(connector=connector, connector_worker=FakeWorker)
    other = eng.add("other", prompt(6, 1), max_tokens=8)
    a = eng.add("a", p, max_tokens=3)
    eng.step()
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KV
    waited = 0
    while a.status == RequestStatus.WAITING_FOR_REMOTE_KV:
        before = other.num_output_tokens
        eng.step()
        assert other.num_output_tokens == before + 1  # the engine kept stepping the others
        waited += 1
    assert waited >= 2
    eng.run()
    assert a.output_token_ids == reference(p, 3)
    assert a.num_cached_tokens == 20  # 5 blocks loaded, the last token computed here
    assert eng.scheduler.loaded_tokens("a") == 0  # finished: forgotten
    assert eng.scheduler.stats.num_loaded_tokens == 20
    assert other.output_token_ids == reference(prompt(6, 1), 8)


def test_a_failed_load_computes_the_prompt(make_engine, reference) -> None:
    p = prompt(18)
    connector = FakeScheduler(store_for(p, 4), fail={"a"})
    eng = make_engine(connector=connector, connector_worker=FakeWorker)
    a = eng.add("a", p, max_tokens=4)
    eng.run()
    assert a.output_token_ids == reference(p, 4)  # the garbage the load left was recomputed
    assert a.num_cached_tokens == 0
    assert eng.scheduler.stats.num_failed_loads == 1 and eng.scheduler.stats.num_loaded_tokens == 0


def test_a_load_that_never_completes_is_given_up_and_its_blocks_reused(make_engine, reference) -> None:
    p = prompt(18)
    connector = FakeScheduler(store_for(p, 4), deadline_steps=4)
    eng = make_engine(connector=connector, connector_worker=lambda m: FakeWorker(m, never_finish=True))
    a = eng.add("a", p, max_tokens=4)
    eng.run()
    assert a.output_token_ids == reference(p, 4)
    assert eng.scheduler.stats.num_timed_out_loads == 1
    assert eng.connector_worker.cancelled == {"a"} and eng.connector_worker.pending == []


def test_abort_while_loading_cancels_before_the_blocks_are_reused(make_engine, reference) -> None:
    p = prompt(18)
    connector = FakeScheduler(store_for(p, 4), delay=5)
    eng = make_engine(num_blocks=6, connector=connector, connector_worker=FakeWorker)
    eng.add("a", p, max_tokens=4)
    eng.step()
    assert eng.pool.num_used_blocks == 4  # room for the 16 loaded tokens
    eng.scheduler.abort(["a"])
    assert eng.pool.num_used_blocks == 0
    # The freed blocks go to a new request in the very step whose metadata cancels the load;
    # the fake worker would write the load's tokens into them if the cancel came late.
    b = eng.add("b", prompt(20, 3), max_tokens=3)
    eng.run()
    assert b.output_token_ids == reference(prompt(20, 3), 3)
    assert eng.connector_worker.cancelled == {"a"}


def test_many_requests_wanting_the_same_blocks_load_them_once(make_engine, reference) -> None:
    p = prompt(22)
    connector = FakeScheduler(store_for(p, 5), delay=2)
    eng = make_engine(connector=connector, connector_worker=FakeWorker)
    requests = [eng.add(f"r{i}", p, max_tokens=3) for i in range(3)]
    eng.run()
    assert connector.loads_started == 1  # the others waited, then hit the prefix cache
    for request in requests:
        assert request.output_token_ids == reference(p, 3)
        assert request.num_cached_tokens == 20


def test_many_requests_loading_the_same_blocks_each_stay_correct(make_engine, reference) -> None:
    """A connector that does not wait for in-flight loads: duplicates, but no corruption or leak."""
    p = prompt(22)
    connector = FakeScheduler(store_for(p, 5), delay=2, wait_for_inflight=False)
    eng = make_engine(connector=connector, connector_worker=FakeWorker)
    requests = [eng.add(f"r{i}", p, max_tokens=3) for i in range(3)]
    eng.run()
    assert connector.loads_started == 3
    for request in requests:
        assert request.output_token_ids == reference(p, 3)


def test_a_synchronous_load_runs_in_the_same_step(make_engine, reference) -> None:
    p = prompt(18)
    connector = FakeScheduler(store_for(p, 3), load_async=False)
    eng = make_engine(connector=connector, connector_worker=FakeWorker)
    a = eng.add("a", p, max_tokens=3)
    eng.step()
    assert eng.summaries[-1] == [("a", 12, 6, True)]  # the 12 loaded tokens are not computed
    eng.run()
    assert a.output_token_ids == reference(p, 3) and a.num_cached_tokens == 12


def test_a_failed_synchronous_load_discards_the_step_and_recomputes(make_engine, reference) -> None:
    p = prompt(18)
    connector = FakeScheduler(store_for(p, 3), load_async=False, fail={"a"})
    eng = make_engine(connector=connector, connector_worker=FakeWorker)
    eng.model.tolerate_garbage.add("a")  # the forward reads the garbage and samples POISON
    a = eng.add("a", p, max_tokens=3)
    eng.step()
    assert a.output_token_ids == [] and a.num_computed_tokens == 0  # its token read garbage: dropped
    eng.run()
    assert a.output_token_ids == reference(p, 3) and a.num_cached_tokens == 0
    assert eng.scheduler.stats.num_failed_loads == 1


def test_held_blocks_outlive_their_request_until_the_lease_ends(make_engine) -> None:
    """The lease keeps blocks from reuse while it lives; after it, a read is refused, never
    answered with whatever another request wrote into the reused blocks."""
    p = prompt(16)
    connector = FakeScheduler({}, hold_steps=3)
    eng = make_engine(num_blocks=6, connector=connector, connector_worker=FakeWorker)
    a = eng.add("a", p, max_tokens=1, eos=frozenset({EOS}))
    eng.step()
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert eng.finished["a"].kv_transfer_params == {"lease": "lease-a"}
    assert eng.pool.num_used_blocks == 4 and eng.scheduler.num_held_blocks == 4
    eng.step()  # the worker side starts serving the lease
    assert eng.connector_worker.read("lease-a") == p
    # A request that needs the whole pool must wait until the lease ends and its blocks return.
    big = eng.add("big", prompt(22, 5), max_tokens=2)
    eng.step()
    assert big.status == RequestStatus.WAITING
    eng.run()
    assert eng.scheduler.num_held_blocks == 0
    assert eng.connector_worker.read("lease-a") is None
    assert big.output_token_ids


def test_aborted_requests_are_not_held(make_engine) -> None:
    connector = FakeScheduler({}, hold_steps=3)
    eng = make_engine(connector=connector, connector_worker=FakeWorker)
    eng.add("a", prompt(16), max_tokens=4)
    eng.step()
    eng.scheduler.abort(["a"])
    assert eng.scheduler.num_held_blocks == 0 and eng.pool.num_used_blocks == 0
    assert connector.finished_requests == ["a"]


def test_loaded_requests_short_of_room_do_not_wait_forever(make_engine, reference) -> None:
    # Two loads fill the pool; then each needs one block more and nothing runs to free any.
    # The scheduler gives one back (its loaded blocks stay cached) so the other can go on.
    a_prompt, b_prompt = prompt(29, 1), prompt(29, 2)
    store = {**store_for(a_prompt, 7), **store_for(b_prompt, 7)}
    eng = make_engine(num_blocks=14, connector=FakeScheduler(store, delay=1), connector_worker=FakeWorker)
    a = eng.add("a", a_prompt, max_tokens=4)
    b = eng.add("b", b_prompt, max_tokens=4)
    eng.run()
    assert a.output_token_ids == reference(a_prompt, 4) and b.output_token_ids == reference(b_prompt, 4)
    assert eng.scheduler.stats.num_reclaimed >= 1
    # Each prompt token is counted once: loaded, or found on the device after a reclaim.
    loaded, stats = eng.scheduler.stats.num_loaded_tokens, eng.kv.stats
    assert loaded + stats.hits == a.num_cached_tokens + b.num_cached_tokens
