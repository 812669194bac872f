"""Fixtures for the torch-free engine core: pools that must end all-free, and a fake model.

Every block pool a test builds through `make_pool` (directly or through `make_engine`) is
checked at teardown: each block back at reference count zero and on the free queue. A leak
anywhere in the pool, the cache manager or the scheduler fails the test that caused it.

`FakeModel` stands in for the model runner. It keeps a simulated paged KV memory: each chunk
writes its tokens into the slots its block table names, and a sampling chunk reads its whole
context back through the block table and derives the next token from what it read. Wrong
block tables, wrong prefix-cache hits or overwritten shared blocks therefore change the output
instead of passing silently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import xxhash

from tandem.batch.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tandem.config import MAX_SPEC_TOKENS, SchedulerConfig
from tandem.engine.block_pool import BlockPool
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.scheduler import FinishedRequest, Scheduler
from tandem.kvcache.block_hash import root_hash
from tandem.spec.speculator import Speculator
from tandem.types import Request, RequestStatus, SampledToken, SamplingParams

BLOCK_SIZE = 4
ROOT = root_hash("test-model", "float32", BLOCK_SIZE)
EOS = 2
POISON = 7  # what the fake model samples from a context it should never have read
VOCAB_LOW, VOCAB_HIGH = 100, 1100  # tokens the fake model emits: never EOS or a small id


def assert_pool_consistent(pool: BlockPool) -> None:
    """The pool's own accounting agrees with its blocks."""
    idle = [b for b in pool.blocks if b.ref_count == 0]
    assert all(b.ref_count >= 0 for b in pool.blocks)
    assert pool.num_free_blocks == len(idle) == len(pool._free)
    # Retention marks only blocks holding a cached prefix (a breakpoint's, block_pool.retain).
    assert all(pool.blocks[i].block_hash is not None for i in pool._free.until)
    assert pool.num_used_blocks == pool.num_blocks - len(idle)
    hashed = [b for b in pool.blocks if b.block_hash is not None]
    assert pool.num_cached_blocks == len(hashed)
    assert len({b.block_hash for b in hashed}) == len(hashed)
    for block in hashed:
        assert block.token_ids is not None
        assert pool.lookup(block.block_hash, block.token_ids) is block


def assert_all_free(pool: BlockPool) -> None:
    assert_pool_consistent(pool)
    assert pool.num_free_blocks == pool.num_blocks, (
        f"{pool.num_blocks - pool.num_free_blocks} KV blocks leaked: "
        f"{[(b.block_id, b.ref_count) for b in pool.blocks if b.ref_count]}"
    )
    assert pool.num_used_blocks == 0
    assert pool.usage == 0.0


@pytest.fixture
def check_pool() -> Callable[[BlockPool], None]:
    """The pool-consistency assertion, for test modules (conftest is not importable)."""
    return assert_pool_consistent


@pytest.fixture
def make_pool() -> Iterator[Callable[..., BlockPool]]:
    """Build block pools that must all be back to all-free when the test ends."""
    pools: list[BlockPool] = []

    def factory(num_blocks: int, enable_caching: bool = True, clock: Callable[[], float] | None = None) -> BlockPool:
        pool = BlockPool(num_blocks, enable_caching) if clock is None else BlockPool(num_blocks, enable_caching,
                                                                                     clock=clock)
        pools.append(pool)
        return pool

    yield factory
    for pool in pools:
        assert_all_free(pool)


@pytest.fixture
def make_kv(make_pool: Callable[..., BlockPool]) -> Callable[..., KVCacheManager]:
    def factory(
        num_blocks: int = 16, block_size: int = BLOCK_SIZE, enable_caching: bool = True
    ) -> KVCacheManager:
        root = root_hash("test-model", "float32", block_size)
        return KVCacheManager(make_pool(num_blocks, enable_caching), block_size, root)

    return factory


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the whole context, never EOS."""
    digest = xxhash.xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in context))
    return VOCAB_LOW + digest % (VOCAB_HIGH - VOCAB_LOW)


@dataclass
class FakeRequestState:
    """What the fake runner knows of a request: only what the plain SchedulerOutput said."""

    prompt: list[int]
    outputs: list[int]
    block_ids: list[int]
    num_computed: int

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs


@dataclass
class Chunk:
    request_id: str
    start: int
    num_tokens: int
    samples: bool
    block_ids: list[int]
    token_ids: list[int]
    draft_token_ids: list[int] = field(default_factory=list)


class FakeModel:
    """A model runner over a simulated paged KV memory (see the module docstring).

    Like the real runner it reads only the scheduler's plain output and keeps its own
    per-request state; `oracle` (the scheduler's live requests) is used only to assert that
    this state and the KV memory match the truth.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        script: dict[str, list[int]] | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.memory: list[list[int | None]] = [[None] * block_size for _ in range(pool.num_blocks)]
        # Per-request token scripts: the i-th sampled token of request r is script[r][i].
        self.script = script or {}
        self.requests: dict[str, FakeRequestState] = {}
        self.last_chunks: list[Chunk] = []
        # Requests whose context may be wrong (a failed KV load a test provokes): instead of
        # failing, the model then samples POISON, which must never reach the output.
        self.tolerate_garbage: set[str] = set()

    def update_states(self, out: SchedulerOutput) -> None:
        for request_id in [*out.finished_request_ids, *out.preempted_request_ids]:
            self.requests.pop(request_id, None)
        for new in out.new_requests:
            self.requests[new.request_id] = FakeRequestState(list(new.prompt_token_ids), list(new.output_token_ids),
                                                             list(new.block_ids), new.num_computed_tokens)
        for cached in out.cached_requests:
            state = self.requests[cached.request_id]
            state.outputs.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed = cached.num_computed_tokens

    def chunks(self, out: SchedulerOutput) -> list[Chunk]:
        chunks = []
        for request_id, count in out.num_scheduled_tokens.items():
            state = self.requests[request_id]
            tokens = state.tokens
            start = state.num_computed
            drafts = out.spec_token_ids.get(request_id, [])
            real = count - len(drafts)
            assert not drafts or start + real == len(tokens), "drafts follow the last known token"
            chunks.append(Chunk(request_id, start, count, start + real == len(tokens), state.block_ids,
                                tokens[start : start + real] + drafts, list(drafts)))
        return chunks

    def write(self, block_ids: list[int], start: int, tokens: list[int]) -> None:
        """Put tokens into the KV memory at positions start..., through a block table."""
        size = self.block_size
        for pos, token in zip(range(start, start + len(tokens)), tokens, strict=True):
            block = self.pool.blocks[block_ids[pos // size]]
            # A published (hashed) or shared block is immutable: writing it would corrupt
            # every other request that reuses it.
            assert block.block_hash is None, f"write into cached block {block.block_id}"
            assert block.ref_count == 1, f"write into shared block {block.block_id}"
            self.memory[block.block_id][pos % size] = token

    def execute(self, out: SchedulerOutput, oracle: dict[str, Request] | None = None) -> ModelRunnerOutput:
        self.update_states(out)
        size = self.block_size
        chunks = self.last_chunks = self.chunks(out)
        for chunk in chunks:
            assert chunk.num_tokens > 0
            end = chunk.start + chunk.num_tokens
            assert len(chunk.block_ids) >= -(-end // size), "block table too short"
            self.write(chunk.block_ids, chunk.start, chunk.token_ids)
        result = ModelRunnerOutput()
        for chunk in chunks:
            if not chunk.samples:
                continue
            state = self.requests[chunk.request_id]
            end = chunk.start + chunk.num_tokens
            stored = [self.memory[chunk.block_ids[p // size]][p % size] for p in range(end)]
            if oracle is not None and chunk.request_id in oracle:
                assert state.tokens == oracle[chunk.request_id].all_token_ids, "runner state drifted"
            expected = state.tokens[: end - len(chunk.draft_token_ids)] + chunk.draft_token_ids
            if stored != expected and chunk.request_id in self.tolerate_garbage:
                result.sampled[chunk.request_id] = [SampledToken(POISON)]
                continue
            assert stored == expected, "KV memory does not hold the context"
            context = stored[: end - len(chunk.draft_token_ids)]
            script = self.script.get(chunk.request_id)
            # Greedy verification: the target's token after the context and after each
            # draft, kept up to and including the first that disagrees with its draft.
            kept: list[SampledToken] = []
            for i in range(len(chunk.draft_token_ids) + 1):
                seen = context + chunk.draft_token_ids[:i]
                token = next_token(seen) if script is None else script[len(state.outputs) + i]
                kept.append(SampledToken(token))
                if i == len(chunk.draft_token_ids) or token != chunk.draft_token_ids[i]:
                    break
            result.sampled[chunk.request_id] = kept
        return result


@dataclass
class Engine:
    """Scheduler + cache manager + pool + fake model, stepped together with invariants checked."""

    scheduler: Scheduler
    model: FakeModel
    finished: dict[str, FinishedRequest] = field(default_factory=dict)
    outputs: list[SchedulerOutput] = field(default_factory=list)
    # (request id, start, num_tokens, samples) per chunk of each step.
    summaries: list[list[tuple[str, int, int, bool]]] = field(default_factory=list)
    connector_worker: Any = None  # a fake connector's worker side (start_load_kv, get_finished)

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    @property
    def pool(self) -> BlockPool:
        return self.scheduler.kv.pool

    def add(
        self,
        request_id: str,
        prompt: list[int],
        eos: frozenset[int] = frozenset({EOS}),
        **params: object,
    ) -> Request:
        params.setdefault("max_tokens", 8)
        kv_transfer_params = params.pop("kv_transfer_params", None)
        retention = params.pop("retention", None)
        request = Request(request_id, list(prompt), SamplingParams(**params), eos,  # type: ignore[arg-type]
                          kv_transfer_params=kv_transfer_params, retention=retention)  # type: ignore[arg-type]
        self.scheduler.add_request(request)
        return request

    def chunks(self, out: SchedulerOutput) -> list[tuple[str, int, int]]:
        """(request id, start, tokens) per scheduled request, from the plain output alone."""
        starts = {n.request_id: n.num_computed_tokens for n in out.new_requests}
        starts.update({c.request_id: c.num_computed_tokens for c in out.cached_requests})
        return [(rid, starts[rid], n) for rid, n in out.num_scheduled_tokens.items()]

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self.check_schedule(out)
        worker = self.connector_worker
        if worker is not None:  # as tandem.worker.Worker does around the forward pass
            worker.start_load_kv(out.kv_connector_metadata)
        result = self.model.execute(out, dict(self.scheduler.requests))
        if worker is not None:
            result.kv_connector_output = worker.get_finished()
        self.summaries.append([(c.request_id, c.start, c.num_tokens, c.samples) for c in self.model.last_chunks])
        for update in self.scheduler.update_from_output(out, result):
            if update.finished is not None:
                self.finished[update.request.request_id] = update.finished
        self.check_state()
        self.outputs.append(out)
        return out

    def run(self, max_steps: int = 1000) -> int:
        steps = 0
        while self.scheduler.has_unfinished() or self.scheduler.pending_kv_work() is not None:
            self.step()
            steps += 1
            assert steps < max_steps, "no progress"
        return steps

    def check_schedule(self, out: SchedulerOutput) -> None:
        config = self.scheduler.config
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(self.scheduler.running) <= config.max_num_seqs
        ids = list(out.num_scheduled_tokens)
        described = [n.request_id for n in out.new_requests] + [c.request_id for c in out.cached_requests]
        assert sorted(ids) == sorted(described), "every scheduled request is described exactly once"
        for request_id, start, num_tokens in self.chunks(out):
            request = self.scheduler.requests[request_id]
            assert request.status == RequestStatus.RUNNING
            assert start == request.num_computed_tokens
            drafts = out.spec_token_ids.get(request_id, [])
            assert start + num_tokens - len(drafts) <= request.num_tokens
            assert not drafts or start + num_tokens - len(drafts) == request.num_tokens
        for request_id in out.preempted_request_ids:
            assert request_id not in ids

    def check_state(self) -> None:
        """Block ownership matches reference counts; progress matches blocks held."""
        pool, kv, size = self.pool, self.kv, self.kv.block_size
        assert_pool_consistent(pool)
        refs = [0] * pool.num_blocks
        for blocks in self.scheduler._held.values():
            for block in blocks:
                refs[block.block_id] += 1
        for request in self.scheduler.requests.values():
            held = kv.block_ids_of(request.request_id)
            assert len(held) == len(set(held)), "a request holds a block twice"
            for block_id in held:
                refs[block_id] += 1
            if request.status == RequestStatus.RUNNING:
                # Blocks allocated for drafts the target rejected stay with the request (the
                # next step writes over them), never more than a full draft window's worth.
                lookahead = MAX_SPEC_TOKENS + 1 if self.scheduler.speculator is not None else 0
                assert -(-request.num_computed_tokens // size) <= len(held)
                assert len(held) <= -(-(request.num_computed_tokens + lookahead) // size)
                assert request.num_computed_tokens < request.num_tokens
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                assert held and request.num_computed_tokens < request.num_tokens
            elif held:  # waiting again after its KV arrived (or failed to): keeps its blocks
                assert request.status == RequestStatus.WAITING
            else:
                assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                assert request.num_computed_tokens == 0
        assert refs == [b.ref_count for b in pool.blocks], "reference counts do not match owners"
        for request_id, done in self.finished.items():
            assert request_id not in self.scheduler.requests
            assert kv.blocks_of(request_id) == []
            assert done.request.status.finished


@pytest.fixture
def make_engine(make_pool: Callable[..., BlockPool]) -> Callable[..., Engine]:
    """Build a scheduler over a fresh pool; the pool must be all-free when the test ends."""

    def factory(
        num_blocks: int = 64,
        max_num_batched_tokens: int = 32,
        max_num_seqs: int = 8,
        max_model_len: int = 256,
        enable_caching: bool = True,
        script: dict[str, list[int]] | None = None,
        connector: Any = None,
        connector_worker: Callable[[FakeModel], Any] | None = None,
        max_concurrent_batches: int = 1,
        speculator: Speculator | None = None,
        clock: Callable[[], float] | None = None,
        run_ahead: bool = False,
    ) -> Engine:
        pool = make_pool(num_blocks, enable_caching, clock)
        kv = KVCacheManager(pool, BLOCK_SIZE, ROOT)
        config = SchedulerConfig(max_num_batched_tokens, max_num_seqs, max_model_len)
        scheduler = Scheduler(config, kv, max_model_len, connector, max_concurrent_batches, speculator,
                              run_ahead=run_ahead)
        model = FakeModel(pool, BLOCK_SIZE, script)
        return Engine(scheduler, model, connector_worker=connector_worker(model) if connector_worker else None)

    return factory


def reference_output(prompt: list[int], num_tokens: int) -> list[int]:
    """What the fake model generates for a prompt when nothing goes wrong."""
    context = list(prompt)
    for _ in range(num_tokens):
        context.append(next_token(context))
    return context[len(prompt) :]


@pytest.fixture
def reference() -> Callable[[list[int], int], list[int]]:
    return reference_output
