"""The engine core: scheduler, KV cache manager and KV connectors in front of an executor.

It holds no model. At start it has the executor start the workers (each loads the model and
reports what its KV budget holds), agrees on one block count, roots the block-hash chain in
the model's fingerprint and builds the torch-free scheduling state. Each `step` schedules,
has the executor run the plain `SchedulerOutput` on every rank, applies the result and
returns per-step deltas: only the tokens that are new, per sequence, so the work and the
bytes per step do not grow with the length of a sequence.

A request with n > 1 is fanned out into n sequences (`id#i`) that share the prompt's cached
blocks once the first has computed them; their deltas are grouped back under the request.
The same object serves the engine core process (core_process.py) and the offline `LLM`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.batch.scheduler_output import SchedulerOutput
from tandem.config import EngineConfig
from tandem.engine.block_pool import BlockPool
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.memory_report import log_memory_split
from tandem.engine.messages import RequestDelta, SequenceDelta
from tandem.engine.scheduler import RequestUpdate, Scheduler
from tandem.executor.base import Executor, WorkerDiedError
from tandem.executor.factory import make_executor
from tandem.kvcache.block_hash import root_hash
from tandem.kvcache.connector.factory import make_connector_scheduler
from tandem.spec.factory import make_speculator
from tandem.types import CacheRetention, EngineLoad, Request, RequestStatus, SamplingParams

if TYPE_CHECKING:
    from tandem.structured.constraints import GrammarConstraints

logger = logging.getLogger(__name__)

_IDLE_KV_POLL_S = 0.005
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class EngineCoreRequest:
    """A validated request, as the engine core takes it (token ids, no text)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prior_output_ids: list[int] | None = None  # generated elsewhere; count as output
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    retention: CacheRetention | None = None  # keep the prompt's marked prefix cached ahead of others


@dataclass
class _Group:
    """A user request: one prompt, n sequences."""

    request_id: str
    sequences: list[Request]
    unfinished: set[int]
    reported: bool = False  # its first delta (queue time, loaded tokens) went out


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None,
                 record_kv_events: bool = False) -> None:
        started = time.perf_counter()
        self.config = config
        self.executor = executor or make_executor(config)
        try:
            infos = self.executor.start()
            block_size = config.cache.block_size
            num_blocks = min(info.num_blocks for info in infos)
            handshakes = self.executor.initialize_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        info = infos[0]
        self.worker_info = info
        self.worker_infos = infos
        self.num_blocks = num_blocks
        self.model_config = info.model_config
        self.model_name = info.model_name
        self.hf_dir = info.hf_dir
        self.fingerprint = info.fingerprint
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self.max_model_len = min(min(i.max_model_len for i in infos), num_blocks * block_size)
        self.block_pool = BlockPool(num_blocks, config.cache.enable_prefix_caching, record_kv_events)
        self.kv_manager = KVCacheManager(self.block_pool, block_size,
                                         root_hash(info.fingerprint, config.load.dtype, block_size))
        connector = make_connector_scheduler(config)
        if connector is not None:
            connector.set_worker_info(handshakes)
        self.speculator = make_speculator(config.speculative, config.kv_transfer.role)
        self.constraints = _grammar_constraints(config, info)
        runs_ahead = self.executor.runs_ahead
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.max_model_len, connector,
                                   1 if runs_ahead else self.executor.max_concurrent_batches, self.speculator,
                                   self.constraints, run_ahead=runs_ahead)
        self._in_flight: deque[SchedulerOutput] = deque()  # submitted, not yet collected
        self.kv_source = connector.endpoints().get("kv_source") if connector is not None else None
        self._groups: dict[str, _Group] = {}
        self._parent: dict[str, tuple[_Group, int]] = {}  # sequence id -> its group and index
        self.startup_seconds = time.perf_counter() - started
        logger.info(
            "KV cache: %d blocks = %d tokens (%.2f GiB, %s); max model len %d; %s attention; %s; ready in %.1f s",
            num_blocks, num_blocks * block_size, num_blocks * info.block_bytes / (1 << 30),
            config.load.dtype if config.cache.kv_cache_dtype == "auto" else f"{config.cache.kv_cache_dtype} rows",
            self.max_model_len, info.attention_backend,
            "1 rank" if len(infos) == 1 else f"{len(infos)} ranks", self.startup_seconds,
        )
        log_memory_split(logger, config, infos, num_blocks)
        logger.info("mode: %s", config.load.mode_line())
        if runs_ahead:
            logger.info("asynchronous scheduling: each step is launched before the last one's tokens reach "
                        "the host (--async-scheduling off: one step at a time)")

    @property
    def root_hash(self) -> int:
        return self.kv_manager.root_hash

    @property
    def block_size(self) -> int:
        return self.kv_manager.block_size

    # --- requests -------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request validated at the edge; a clash with engine state raises ValueError."""
        request_id = request.request_id
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = request.params
        self._check_request(request)
        if (request.prior_output_ids or request.kv_transfer_params) and params.n != 1:
            raise ValueError("a KV handoff (prior output or kv_transfer_params) needs n == 1")
        sequences = []
        for index in range(params.n):
            child_params = params if params.n == 1 else params.for_child(index)
            seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
            sequences.append(Request(seq_id, list(request.prompt_token_ids), child_params, self.eos_token_ids,
                                     arrival_time=request.arrival_time,
                                     output_token_ids=list(request.prior_output_ids or []),
                                     cache_salt=request.cache_salt, retention=request.retention,
                                     kv_transfer_params=request.kv_transfer_params))
        group = _Group(request_id, sequences, set(range(params.n)))
        first = sequences[0]
        self.kv_manager.update_block_hashes(first)
        expected_hit = self.kv_manager.cached_prefix_blocks(first) * self.block_size
        for index, sequence in enumerate(sequences):
            if index:
                sequence.block_hashes = list(first.block_hashes)  # same tokens, same chain
            sequence.expected_cached_tokens = min(expected_hit, first.num_prompt_tokens - 1)
            self.scheduler.add_request(sequence)
            if self.constraints is not None:
                self.constraints.add(sequence)  # compiles meanwhile; admitted once compiled
            self._parent[sequence.request_id] = (group, index)
        self._groups[request_id] = group

    def _check_request(self, request: EngineCoreRequest) -> None:
        """The engine's own range checks (ValueError), behind the edge's: whatever reaches the
        core (a peer's handoff tokens, a caller of `LLM`) is held to what the model can take."""
        request.params.validate(vocab_size=self.model_config.vocab_size)
        if request.params.guided is not None and self.constraints is None:
            raise ValueError("structured outputs need the model's tokenizer, and this model directory has none")
        if request.retention is not None:
            if not isinstance(request.retention, CacheRetention):
                raise ValueError("retention must be a CacheRetention")
            request.retention.validate()
        vocab = self.model_config.vocab_size
        for name, tokens in (("prompt", request.prompt_token_ids), ("prior output", request.prior_output_ids or [])):
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in tokens):
                raise ValueError(f"{name} token ids must be integers in [0, {vocab})")
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(request.prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"a prompt of {len(request.prompt_token_ids)} tokens leaves no room in the "
                             f"context of {self.max_model_len}")
        total = len(request.prompt_token_ids) + len(request.prior_output_ids or [])
        if total > self.max_model_len:
            raise ValueError(f"{total} tokens are more than the context of {self.max_model_len}")

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            group = self._groups.pop(request_id, None)
            if group is None:
                continue
            for sequence in group.sequences:
                self._parent.pop(sequence.request_id, None)
            self.scheduler.abort(s.request_id for s in group.sequences)

    def finish_sequence(self, request_id: str, index: int) -> None:
        """Stop one sequence of a request for a reason found outside (a stop string in text)."""
        group = self._groups.get(request_id)
        if group is None or index not in group.unfinished:
            return
        self.scheduler.finish(group.sequences[index].request_id, RequestStatus.FINISHED_STOPPED)
        self._sequence_done(group, index)

    def _sequence_done(self, group: _Group, index: int) -> None:
        group.unfinished.discard(index)
        if not group.unfinished:
            self._groups.pop(group.request_id, None)
            for sequence in group.sequences:
                self._parent.pop(sequence.request_id, None)

    def release_hold(self, hold_id: str) -> None:
        self.scheduler.release_hold(hold_id)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._groups

    def has_unfinished(self) -> bool:
        """Requests to serve, or steps in flight still to collect (their requests may have
        been aborted meanwhile: the ranks answer anyway, in order)."""
        return bool(self._groups) or bool(self._in_flight)

    @property
    def has_in_flight(self) -> bool:
        return bool(self._in_flight)

    @property
    def num_unfinished(self) -> int:
        return len(self._groups)

    def pending_kv_work(self) -> float | None:
        return self.scheduler.pending_kv_work()

    # --- stepping -------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """One scheduler + model step; a delta for every request that changed.

        A step whose forward raises (a request the edge let through that the model or the
        sampler cannot take) does not stop the engine when the executor can go on after it
        (`Executor.recovers_from_step_errors`): the step is undone, a request that ran alone is
        aborted with an error delta naming the failure, and the requests of a batch that failed
        run alone, one per step, until the one that fails again is found (scheduler.py
        `step_failed`). The others keep their place and their output."""
        if self.executor.max_concurrent_batches > 1:
            try:
                return self._pipelined_step() + self._grammar_failures()
            except _SubmitFailed as failed:
                return failed.deltas + self._step_failed(failed.out, failed.error)
        out = self.scheduler.schedule()
        try:
            return self._run_now(out) + self._grammar_failures()
        except WorkerDiedError:
            raise
        except Exception as exc:
            if not self.executor.recovers_from_step_errors or out.empty:
                raise
            return self._step_failed(out, exc)

    def _grammar_failures(self) -> list[RequestDelta]:
        """End each request whose grammar failed to compile (found at admission) with an error
        delta naming the problem; its other sequences too."""
        if self.constraints is None:
            return []
        deltas = []
        for sequence_id, why in self.constraints.failures():
            entry = self._parent.get(sequence_id)
            if entry is None:
                continue
            group = entry[0]
            self.abort([group.request_id])
            deltas.append(RequestDelta(group.request_id, [], True, 0,
                                       error=f"the request's grammar cannot be used: {why}"))
        return deltas

    def _step_failed(self, out: SchedulerOutput, exc: Exception) -> list[RequestDelta]:
        failed = self.scheduler.step_failed(out)
        if len(failed) > 1:
            logger.warning("a step of %d requests failed (%s: %s); running them one at a time to find the "
                           "one that fails", len(failed), type(exc).__name__, exc)
            return []
        sequence_id = failed[0]
        entry = self._parent.get(sequence_id)
        logger.error("request %s failed inside the engine and is stopped; the engine serves the others",
                     sequence_id, exc_info=exc)
        if entry is None:
            self.scheduler.abort([sequence_id])
            return []
        group, _ = entry
        self.abort([group.request_id])
        return [RequestDelta(group.request_id, [], True, 0,
                             error=f"this request failed inside the engine and was stopped "
                                   f"({type(exc).__name__}: {exc}); the server keeps serving others")]

    def _pipelined_step(self) -> list[RequestDelta]:
        """Keep a micro-batch in flight per pipeline stage: submit while there is room and
        work, then collect the oldest. Stage 0 starts the next micro-batch while the later
        stages work on earlier ones; a call that only submitted returns no deltas."""
        in_flight = self._in_flight
        if len(in_flight) < self.executor.max_concurrent_batches:
            out = self.scheduler.schedule()
            if not in_flight and out.empty:
                return self._run_now(out)  # nothing moving: the plain path (KV polling, idling)
            if not out.empty or out.finished_request_ids or out.kv_connector_metadata is not None:
                try:
                    self.executor.submit(out)
                except WorkerDiedError:
                    raise
                except Exception as exc:
                    if not self.executor.recovers_from_step_errors or out.empty:
                        raise
                    raise _SubmitFailed(out, exc, self._drain()) from exc
                in_flight.append(out)
                if not out.empty and len(in_flight) < self.executor.max_concurrent_batches:
                    return []
        out = in_flight.popleft()
        result = self.executor.collect()
        return self._deltas(self.scheduler.update_from_output(out, result))

    def _drain(self) -> list[RequestDelta]:
        """Collect every step in flight, oldest first, and apply it."""
        deltas = []
        while self._in_flight:
            out = self._in_flight.popleft()
            deltas += self._deltas(self.scheduler.update_from_output(out, self.executor.collect()))
        return deltas

    def _run_now(self, out: SchedulerOutput) -> list[RequestDelta]:
        if (out.empty and out.kv_connector_metadata is None and not out.finished_request_ids
                and not out.reset_request_ids):
            if self.constraints is not None and self.constraints.wait_for_compile(_IDLE_KV_POLL_S):
                return []  # a grammar compiled (or the wait ran out): schedule again
            pending = self.pending_kv_work()
            if pending is None:
                return []
            # Nothing to compute, only KV arriving in the background: wait a little before
            # polling for it, rather than spinning on empty steps that starve the loader
            # threads of the GIL (a spinning loop made a 190 MB tier load 5x slower).
            time.sleep(min(pending, _IDLE_KV_POLL_S))
        started = time.perf_counter()
        result = self.executor.execute_model(out)
        if self.speculator is not None and not out.empty:
            # The target's share: a draft model's forwards inside the step are costed apart.
            seconds = time.perf_counter() - started - result.draft_seconds
            self.speculator.observe_step(out.total_num_scheduled_tokens, seconds)
        updates = self.scheduler.update_from_output(out, result)
        return self._deltas(updates)

    def _deltas(self, updates: list[RequestUpdate]) -> list[RequestDelta]:
        deltas: dict[str, RequestDelta] = {}
        for update in updates:
            entry = self._parent.get(update.request.request_id)
            if entry is None:
                continue
            group, index = entry
            delta = deltas.get(group.request_id)
            if delta is None:
                delta = deltas[group.request_id] = self._new_delta(group)
            request, tokens, finished = update.request, update.tokens, update.finished
            logprobs = None
            if request.sampling_params.logprobs is not None and tokens:
                logprobs = [token.top_logprobs or [] for token in tokens]
            delta.sequences.append(SequenceDelta(
                index=index,
                token_ids=[token.token_id for token in tokens],
                logprobs=logprobs,
                finish_reason=None if finished is None else finished.reason.value,
                stop_reason=None if finished is None else request.stop_reason,
            ))
            if finished is not None:
                if finished.kv_transfer_params is not None:
                    delta.kv_transfer_params = finished.kv_transfer_params
                self._sequence_done(group, index)
                delta.finished = group.request_id not in self._groups
        return list(deltas.values())

    def _new_delta(self, group: _Group) -> RequestDelta:
        cached = max(max(s.num_cached_tokens for s in group.sequences), 0)
        delta = RequestDelta(group.request_id, [], False, cached)
        if not group.reported:
            group.reported = True
            first = group.sequences[0]
            if first.first_scheduled_time is not None:
                delta.queue_seconds = first.first_scheduled_time - first.arrival_time
            delta.num_loaded_tokens = self.scheduler.loaded_tokens(first.request_id)
        return delta

    # --- state ----------------------------------------------------------------------
    def load(self) -> EngineLoad:
        scheduler, pool = self.scheduler, self.block_pool
        # A waiting request's cached prefix costs nothing to compute: a router balancing
        # prefill work must not see a 6,000-token turn with 5,700 cached as 6,000 tokens.
        waiting_tokens = sum(
            r.num_tokens - max(r.num_computed_tokens, r.expected_cached_tokens) for r in scheduler.waiting
        )
        prefilling = sum(
            r.num_tokens - r.num_computed_tokens for r in scheduler.running
            if r.num_tokens - r.num_computed_tokens > 1
        )
        stats = self.kv_manager.stats
        connector = scheduler.connector
        return EngineLoad(
            num_waiting=len(scheduler.waiting),
            num_running=len(scheduler.running),
            waiting_prefill_tokens=waiting_tokens + prefilling,
            running_kv_tokens=sum(r.num_computed_tokens for r in scheduler.running),
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_total=pool.num_blocks,
            kv_blocks_cached=pool.num_cached_blocks,
            kv_blocks_retained=pool.num_retained_blocks,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            connector_loaded_tokens=scheduler.stats.num_loaded_tokens,
            num_preemptions=scheduler.num_preemptions,
            connectors=connector.counters_by_section() if connector is not None else {},
            spec_decode=self.speculator.stats.as_dict() if self.speculator is not None else {},
            structured=self.constraints.stats.as_dict() if self.constraints is not None else {},
        )

    def drain_kv_events(self) -> list[tuple]:
        """The block pool's KV events (device) and then the connectors' (lower tiers)."""
        events: list[tuple] = list(self.block_pool.drain_events())
        connector = self.scheduler.connector
        if connector is not None:
            events += connector.drain_events()
        return events

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call a worker method on every rank between steps (profiling); with no request
        running, after collecting whatever steps are still in flight."""
        if self._groups:
            raise RuntimeError("collective_rpc while requests run")
        self._drain()
        return self.executor.collective_rpc(method, *args)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def shutdown(self) -> None:
        if self.constraints is not None:
            self.constraints.shutdown()
        self.executor.shutdown()


class _SubmitFailed(Exception):
    """A step that raised as it was submitted, with the deltas of the steps collected after it
    (asynchronous scheduling: the step before it was still in flight)."""

    def __init__(self, out: SchedulerOutput, error: Exception, deltas: list[RequestDelta]) -> None:
        super().__init__(str(error))
        self.out, self.error, self.deltas = out, error, deltas


def _grammar_constraints(config: EngineConfig, info: Any) -> GrammarConstraints | None:
    """The matchers for constrained requests, from the model's tokenizer; None when the model
    directory has none (a bare test model): such an engine refuses constrained requests."""
    hf_dir = Path(info.hf_dir) if info.hf_dir else None
    if hf_dir is None or not any((hf_dir / name).is_file() for name in TOKENIZER_FILES):
        return None
    from tandem.structured.constraints import (  # numpy, llguidance: lazily
        GrammarConstraints,
        TokenizerSource,
    )

    source = TokenizerSource(hf_dir, info.model_config.vocab_size, sorted(info.eos_token_ids))
    return GrammarConstraints(source, jump_forward=config.scheduler.jump_forward)

