"""Continuous batching under one token budget per step. Torch-free.

Every step moves each scheduled request's `num_computed_tokens` toward its `num_tokens`:
a decode is one token, a prefill is as many prompt tokens as the budget allows (chunked
prefill). Running requests go first, in arrival order, so decodes are never starved by new
prefills; waiting requests are admitted FCFS with their cached prefix skipped. When blocks run
out, the most recently admitted running request is preempted and later recomputed.

A KV connector may supply more of a prompt than the local prefix cache holds: its tokens are
loaded into blocks allocated here, asynchronously while the request waits in
WAITING_FOR_REMOTE_KV (the others keep stepping), or synchronously within the step. The
scheduler emits a plain `SchedulerOutput` (scheduler_output.py): model runners, in this
process or on other ranks, never see a live `Request`.

Under pipeline parallelism the engine keeps several steps (micro-batches) in flight, so
`schedule` may run before earlier steps' results are in. A request whose step is in flight is
not scheduled again until its result arrives (its next token is unknown), except a prompt
whose in-flight chunk samples nothing: its next chunk may follow at once, since every stage
runs the micro-batches in order. Such requests are never preempted (a stage may still be
writing their blocks), and each micro-batch takes at most its share of the running requests
and of the tokens to compute, so that the next one has work for the stage the first has left.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.batch.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tandem.config import SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.kvcache.connector.base import KVConnectorOutput, KVConnectorScheduler
from tandem.spec.speculator import Candidate, Speculator
from tandem.types import Request, RequestStatus, SampledToken

if TYPE_CHECKING:  # numpy and llguidance load only when a model can take constraints
    from tandem.structured.constraints import GrammarConstraints

logger = logging.getLogger(__name__)

_MIN_MICRO_BATCH = 128  # tokens: below this a micro-batch's GEMMs get thin for little gain


@dataclass
class FinishedRequest:
    request: Request
    reason: RequestStatus
    kv_transfer_params: dict[str, Any] | None = None  # a connector's word on the request's KV


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request: new tokens (several when drafts were accepted), an
    end, or both."""

    request: Request
    tokens: list[SampledToken] = field(default_factory=list)
    finished: FinishedRequest | None = None


@dataclass
class _ExternalKV:
    """A request whose prompt KV partly comes through a connector."""

    num_local_tokens: int  # the local prefix hit, already computed
    num_external_tokens: int
    load_async: bool
    loaded_this_step: bool = False
    loaded: bool = False  # the load succeeded: its tokens count as cached


@dataclass(slots=True)
class _RunnerView:
    """How much of a request the model runner has seen (it is sent only what is new)."""

    num_tokens: int
    num_blocks: int


@dataclass
class SchedulerStats:
    num_preemptions: int = 0  # cumulative
    num_loaded_tokens: int = 0  # prompt tokens whose KV a connector supplied, cumulative
    num_failed_loads: int = 0
    num_timed_out_loads: int = 0
    num_reclaimed: int = 0  # waiting requests whose loaded blocks were freed for another


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int,
                 connector: KVConnectorScheduler | None = None, max_concurrent_batches: int = 1,
                 speculator: Speculator | None = None, constraints: GrammarConstraints | None = None,
                 run_ahead: bool = False) -> None:
        """`max_concurrent_batches`: pipeline micro-batches in flight, each taking its share of
        the running requests. `run_ahead`: asynchronous scheduling, one step in flight while the
        next is scheduled over the same requests (`_runs_ahead`)."""
        self.config = config
        self.speculator = speculator
        # Grammar-constrained requests' matchers (tandem/structured): compiled before admission,
        # drafts checked, the step's masks, tokens accepted and forced.
        self.constraints = constraints
        self.max_concurrent_batches = max_concurrent_batches
        self._in_flight: dict[str, int] = {}  # request id -> its tokens in steps not yet reported
        self.run_ahead = run_ahead
        # Asynchronous scheduling: request id -> steps in flight that sample it (tokens the
        # device will know before the host does).
        self._sampling_in_flight: dict[str, int] = {}
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_since_step: list[str] = []
        self._runner: dict[str, _RunnerView] = {}
        self._external: dict[str, _ExternalKV] = {}
        self._held: dict[str, list] = {}  # hold id -> blocks a connector keeps after their request ended
        # After a failed step (engine_core.py): its requests, each to run alone once so that the
        # one that fails again is known; and the ids the runner must forget before they rerun.
        self._suspects: list[str] = []
        self._reset_since_step: list[str] = []

    @property
    def num_preemptions(self) -> int:
        return self.stats.num_preemptions

    # --- queue management -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Its prompt and parameters were validated at the edge (the API
        server or `LLM`); only engine state is checked here."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.kv.update_block_hashes(request)
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                aborted.append(request)
        return aborted

    def finish(self, request_id: str, reason: RequestStatus) -> None:
        """Finish a request for a reason decided outside (a stop string, found in the text)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, reason)

    def _finish(self, request: Request, reason: RequestStatus) -> FinishedRequest:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = reason
        decision = None
        if self.connector is not None:
            decision = self.connector.request_finished(request, self.kv.block_ids_of(request.request_id))
        kept = self.kv.free(request, decision.num_blocks if decision else 0)
        if kept:
            assert decision is not None and decision.hold_id is not None
            self._held[decision.hold_id] = kept
        del self.requests[request.request_id]
        if self.speculator is not None:
            self.speculator.request_finished(request)
        if self.constraints is not None:
            self.constraints.forget(request.request_id)
        self._in_flight.pop(request.request_id, None)
        self._sampling_in_flight.pop(request.request_id, None)
        self._external.pop(request.request_id, None)
        self._runner.pop(request.request_id, None)
        self._finished_since_step.append(request.request_id)
        return FinishedRequest(request, reason, decision.kv_transfer_params if decision else None)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._held.values())

    # --- one step -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_since_step,
                              reset_request_ids=self._reset_since_step)
        self._finished_since_step = []
        self._reset_since_step = []
        self._give_up_late_loads()
        # Suspects run alone, one step at a time: under asynchronous scheduling the step in
        # flight lands first.
        if self._suspects and (self._in_flight or self._schedule_suspect(out)):
            if self.connector is not None:
                out.kv_connector_metadata = self.connector.build_connector_meta(out)
            self._request_masks(out)
            return out
        budget = self._micro_batch_budget()

        # With micro-batches in flight, each takes at most its share of the running requests.
        room = len(self.running)
        if self.max_concurrent_batches > 1:
            room = -(-len(self.running) // self.max_concurrent_batches)
        index = 0
        reaching_end: list[Request] = []  # scheduled up to their last known token: may take drafts
        while index < len(self.running) and budget > 0 and room > 0:
            request = self.running[index]
            pending = self._in_flight.get(request.request_id, 0)
            num_new = min(request.num_tokens - request.num_computed_tokens - pending, budget)
            ahead = num_new <= 0 and self._runs_ahead(request, pending)
            if ahead:
                num_new = 1  # its input: the token its in-flight step samples, on the device
            elif num_new <= 0:  # its in-flight step samples: the next token is not known yet
                index += 1
                continue
            stalled = False
            while not self.kv.allocate_slots(request, pending + num_new):
                victim = self._preemption_victim()
                if victim is None:
                    stalled = True  # every candidate is in flight: wait for a step to land
                    break
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            if stalled or request.status != RequestStatus.RUNNING:
                break
            self._schedule_chunk(out, request, num_new)
            if ahead:
                out.last_step_inputs.append(request.request_id)
            if pending + num_new == request.num_tokens - request.num_computed_tokens:
                reaching_end.append(request)
            budget -= num_new
            room -= 1
            index += 1

        if self.speculator is not None and reaching_end and budget > 0:
            budget = self._add_drafts(out, reaching_end, budget)
        if not out.preempted_request_ids:
            budget = self._admit_waiting(out, budget)

        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self._request_masks(out)
        return out

    def _runs_ahead(self, request: Request, pending: int) -> bool:
        """Whether `request` may take a decode step now whose input is the token its in-flight
        step samples (asynchronous scheduling): its known and in-flight tokens all run, that
        token will not end it (max_tokens, the context), and nothing its next step does on the
        host needs that token: no penalties over its output, no min_tokens still pending (the
        runner counts its output from the tokens the host sent), no grammar (the matcher
        advances on the host), no KV load in the step that samples (a failed load discards the
        token). An end of sequence the in-flight step samples wastes the step ahead's row: its
        token is dropped when it comes back."""
        if not self.run_ahead:
            return False
        request_id = request.request_id
        sampling = self._sampling_in_flight.get(request_id, 0)
        if sampling == 0 or request.num_computed_tokens + pending != request.num_tokens + sampling - 1:
            return False
        params = request.sampling_params
        if params.has_penalties:
            return False
        if request.num_output_tokens < params.min_tokens:
            return False
        if params.max_tokens is not None and request.num_output_tokens + sampling >= params.max_tokens:
            return False
        if request.num_tokens + sampling >= self.max_model_len:
            return False
        if self.constraints is not None and self.constraints.is_constrained(request_id):
            return False
        external = self._external.get(request_id)
        return external is None or not external.loaded_this_step

    def _request_masks(self, out: SchedulerOutput) -> None:
        """Have the constrained requests that sample this step get their token masks, one row
        per sampled position, computed while the step runs."""
        constraints = self.constraints
        if constraints is None or out.empty:
            return
        sampling = []
        for request_id in out.num_scheduled_tokens:
            if not constraints.is_constrained(request_id):
                continue
            request = self.requests[request_id]
            drafts = out.spec_token_ids.get(request_id, [])
            if request.num_computed_tokens + self._in_flight[request_id] - len(drafts) >= request.num_tokens:
                sampling.append((request_id, drafts))
        out.token_masks = constraints.masks(sampling)

    # --- a step that raised ---------------------------------------------------------
    def step_failed(self, out: SchedulerOutput) -> list[str]:
        """Undo a step whose forward raised: its requests keep their tokens and blocks (nothing
        was published from them), their progress stays where it was, and the runner is told to
        forget them so that it gets each whole again. Returns the ids of the step's requests.
        Requests of a step that failed alone are the caller's to abort; several become suspects
        that run alone, one per step, until each has stepped once (`_schedule_suspect`)."""
        failed = list(out.num_scheduled_tokens)
        for request_id in failed:
            self._in_flight.pop(request_id, None)
            self._sampling_in_flight.pop(request_id, None)
            self._runner.pop(request_id, None)
            self._reset_since_step.append(request_id)
            request = self.requests.get(request_id)
            if request is None:
                continue
            request.spec_token_ids = []
            external = self._external.get(request_id)
            if external is not None and external.loaded_this_step and request.status == RequestStatus.RUNNING:
                external.loaded_this_step = False
                self._roll_back_failed_sync_load(request, external)
        if len(failed) > 1:
            self._suspects = [r for r in failed if r in self.requests] + [
                r for r in self._suspects if r not in failed]
        return failed

    def _schedule_suspect(self, out: SchedulerOutput) -> bool:
        """Schedule the first live suspect alone; False when none can run now."""
        while self._suspects:
            request = self.requests.get(self._suspects[0])
            if request is None or request.status != RequestStatus.RUNNING:
                self._suspects.pop(0)  # finished, aborted or sent back to wait: no longer in question
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, self.config.max_num_batched_tokens)
            if num_new <= 0 or not self.kv.allocate_slots(request, num_new):
                self._suspects.pop(0)  # cannot run alone now: it rejoins the others
                continue
            self._schedule_chunk(out, request, num_new)
            return True
        return False

    def _add_drafts(self, out: SchedulerOutput, requests: list[Request], budget: int) -> int:
        """Extend the chunks of requests that will sample with draft tokens to verify, as many
        as the speculator finds worth it, in the budget and blocks left (no preemption for
        a guess)."""
        assert self.speculator is not None
        candidates = []
        for request in requests:
            if not request.sampling_params.speculate:
                continue
            params = request.sampling_params
            left = self.max_model_len - request.num_tokens - 1
            if params.max_tokens is not None:
                left = min(left, params.max_tokens - request.num_output_tokens - 1)
            if left > 0:
                candidates.append(Candidate(request, left))
        if not candidates:
            return budget
        num_sampling = len(requests)  # each yields a token anyway
        plan = self.speculator.plan(candidates, out.total_num_scheduled_tokens, num_sampling, budget)
        if self.speculator.lookahead:
            out.draft_lookahead = self.speculator.guesses_wanted(candidates, out.total_num_scheduled_tokens,
                                                                 num_sampling)
        for candidate in candidates:
            request = candidate.request
            request_id = request.request_id
            drafts = plan.get(request_id, [])
            if drafts and self.constraints is not None:
                drafts = self.constraints.valid_drafts(request, drafts)  # none the grammar forbids
            # A worker-side proposer (a draft model) writes its own KV past the verified
            # tokens: the next token's and its guesses'. Room for them if there is any; it
            # proposes fewer where there is not.
            lookahead = min(self.speculator.lookahead, candidate.cap) if out.draft_lookahead.get(request_id) else 0
            if not drafts and not lookahead:
                continue
            num_new = out.num_scheduled_tokens[request_id] + len(drafts)
            pending = self._in_flight.get(request_id, 0) - out.num_scheduled_tokens[request_id]
            if lookahead:
                self.kv.allocate_slots(request, pending + num_new + lookahead)
            if drafts and not self.kv.allocate_slots(request, pending + num_new):
                drafts = []
            self._send_new_blocks(out, request)
            request.spec_token_ids = []
            if not drafts:
                continue
            out.num_scheduled_tokens[request_id] = num_new
            out.spec_token_ids[request_id] = drafts
            self._in_flight[request_id] += len(drafts)
            budget -= len(drafts)
        return budget

    def _send_new_blocks(self, out: SchedulerOutput, request: Request) -> None:
        """Blocks allocated after the request's entry in `out` was written go out with it."""
        request_id = request.request_id
        view = self._runner[request_id]
        num_blocks = self.kv.num_blocks_of(request_id)
        if num_blocks <= view.num_blocks:
            return
        new_ids = self.kv.block_ids_of(request_id, view.num_blocks)
        for new in out.new_requests:
            if new.request_id == request_id:
                new.block_ids = new.block_ids + new_ids
                break
        else:
            for cached in out.cached_requests:
                if cached.request_id == request_id:
                    cached.new_block_ids = cached.new_block_ids + new_ids
                    break
        view.num_blocks = num_blocks

    def _micro_batch_budget(self) -> int:
        """The step's token budget. With micro-batches in flight, a step takes its share of
        the work there is (and at least `_MIN_MICRO_BATCH`), so that prompts arriving together
        fill every stage of the pipeline instead of one micro-batch with the others empty."""
        budget = self.config.max_num_batched_tokens
        depth = self.max_concurrent_batches
        if depth == 1:
            return budget
        # The work in flight counts too: two micro-batches share what there is between them.
        work = sum(r.num_tokens - r.num_computed_tokens for r in self.running)
        work += sum(r.num_tokens - r.num_computed_tokens for r in self.waiting
                    if r.status != RequestStatus.WAITING_FOR_REMOTE_KV)
        return min(budget, max(_MIN_MICRO_BATCH, -(-work // depth)))

    def _preemption_victim(self) -> Request | None:
        """The most recently admitted running request with no step in flight."""
        for request in reversed(self.running):
            if request.request_id not in self._in_flight:
                return request
        return None

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        skipped: deque[Request] = deque()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KV or (
                    self.constraints is not None and not self.constraints.ready(request)):
                skipped.append(request)  # its KV or its grammar is still on its way
                continue
            if self.kv.num_blocks_of(request.request_id):
                # Its KV was loaded (or the load failed) into blocks it already holds.
                computed_blocks, num_cached = [], request.num_computed_tokens
            else:
                computed_blocks, num_cached = self.kv.get_computed_blocks(request)
                external = self._ask_connector(request, num_cached)
                if external is None:
                    skipped.append(request)
                    continue
                if external.num_external_tokens and external.load_async:
                    if not self.kv.allocate_slots(request, external.num_external_tokens, computed_blocks):
                        self.waiting.appendleft(request)
                        if not self.running and self._reclaim_from_waiting(request):
                            continue
                        break
                    self._start_async_load(request, num_cached, external)
                    skipped.append(request)
                    continue
                if external.num_external_tokens:
                    num_new = min(request.num_tokens - num_cached - external.num_external_tokens, budget)
                    if not self._allocate_with_sync_load(request, computed_blocks, external, num_new):
                        self.waiting.appendleft(request)
                        if not self.running and self._reclaim_from_waiting(request):
                            continue
                        break
                    num_cached += external.num_external_tokens
                    computed_blocks = None  # allocated
            num_new = min(request.num_tokens - num_cached, budget)
            if computed_blocks is not None and not self.kv.allocate_slots(request, num_new, computed_blocks):
                self.waiting.appendleft(request)
                if not self.running and self._reclaim_from_waiting(request):
                    continue  # retry with the blocks another waiting request gave back
                break
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                # First admission only: a recomputation after preemption hits its own
                # blocks, which says nothing about how well the prefix cache serves prompts.
                request.num_cached_tokens = num_cached
                external = self._external.get(request.request_id)
                local = num_cached if external is None else external.num_local_tokens
                self.kv.record_prefix_lookup(request, local)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            self._schedule_chunk(out, request, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _reclaim_from_waiting(self, keep: Request) -> bool:
        """Free the blocks of one waiting request whose KV load has ended (the newest first).

        Loaded requests wait holding their blocks; with nothing running, nothing else would
        ever free any, and two of them each short of room would wait forever. The freed blocks
        keep what the load put in them, published to the prefix cache, so the request finds
        them there again when it is admitted."""
        for request in reversed(self.waiting):
            if request is keep or request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                continue
            if self.kv.num_blocks_of(request.request_id):
                self.kv.free(request)
                request.num_computed_tokens = 0
                external = self._external.pop(request.request_id, None)
                if external is not None and external.loaded:
                    # Readmitted, it finds these tokens on the device and counts them there.
                    self.stats.num_loaded_tokens -= external.num_external_tokens
                self.stats.num_reclaimed += 1
                return True
        return False

    def _ask_connector(self, request: Request, num_cached: int) -> _ExternalKV | None:
        """How much more of the prompt a connector supplies; None: ask again next step."""
        if self.connector is None or request.num_preemptions or request.request_id in self._external:
            return _ExternalKV(num_cached, 0, False)
        offer = self.connector.get_num_new_matched_tokens(request, num_cached)
        if offer is None:
            return None
        num_external, load_async = offer
        # The last token is always computed here: its logits give the next token.
        num_external = max(0, min(num_external, request.num_tokens - 1 - num_cached))
        return _ExternalKV(num_cached, num_external, load_async)

    def _start_async_load(self, request: Request, num_cached: int, external: _ExternalKV) -> None:
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._external[request.request_id] = external
        assert self.connector is not None
        self.connector.update_state_after_alloc(request, self.kv.block_ids_of(request.request_id),
                                                external.num_external_tokens)

    def _allocate_with_sync_load(self, request: Request, computed_blocks: list, external: _ExternalKV,
                                 num_new: int) -> bool:
        """Room for a synchronous load and this step's chunk at once, or nothing changes.

        The worker side loads the external tokens before this step's forward reads them.
        """
        if not self.kv.allocate_slots(request, external.num_external_tokens + num_new, computed_blocks):
            return False
        request.num_computed_tokens = external.num_local_tokens
        external.loaded_this_step = external.loaded = True
        self._external[request.request_id] = external
        assert self.connector is not None
        self.connector.update_state_after_alloc(request, self.kv.block_ids_of(request.request_id),
                                                external.num_external_tokens)
        self.stats.num_loaded_tokens += external.num_external_tokens
        return True

    def _schedule_chunk(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        """Describe the request to the runner: all of it the first time, then what is new."""
        request_id = request.request_id
        view = self._runner.get(request_id)
        num_blocks = self.kv.num_blocks_of(request_id)
        if view is None:
            out.new_requests.append(NewRequestData(
                request_id=request_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                eos_token_ids=tuple(sorted(request.eos_token_ids)),
                block_ids=self.kv.block_ids_of(request_id),
                num_computed_tokens=request.num_computed_tokens,
            ))
            self._runner[request_id] = _RunnerView(request.num_tokens, num_blocks)
        else:
            pending = self._in_flight.get(request_id, 0)
            out.cached_requests.append(CachedRequestData(
                request_id=request_id,
                new_token_ids=request.all_token_ids[view.num_tokens:],
                new_block_ids=self.kv.block_ids_of(request_id, view.num_blocks) if num_blocks > view.num_blocks
                else [],
                num_computed_tokens=request.num_computed_tokens + pending,  # after its in-flight chunk
            ))
            view.num_tokens, view.num_blocks = request.num_tokens, num_blocks
        out.num_scheduled_tokens[request_id] = num_new
        pending = self._in_flight.get(request_id, 0) + num_new
        self._in_flight[request_id] = pending
        if self.run_ahead:
            sampling = self._sampling_in_flight.get(request_id, 0)
            if request.num_computed_tokens + pending == request.num_tokens + sampling:
                self._sampling_in_flight[request_id] = sampling + 1  # this chunk samples

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self.running.remove(request)
        self.kv.free(request)
        self._runner.pop(request.request_id, None)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1

    # --- after the model ran ----------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestUpdate]:
        """Advance progress after a step; returns what happened to each request it touched."""
        updates: list[RequestUpdate] = []
        connector_output = result.kv_connector_output
        failed = connector_output.failed_loads if connector_output is not None else ()
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            if self._suspects and request_id in self._suspects:
                self._suspects.remove(request_id)  # it stepped: not the one that raises
            pending = self._in_flight.get(request_id, 0) - num_tokens
            if pending > 0:
                self._in_flight[request_id] = pending
            else:
                self._in_flight.pop(request_id, None)
            if request_id in self._sampling_in_flight and result.sampled.get(request_id):
                sampling = self._sampling_in_flight[request_id] - 1
                if sampling > 0:
                    self._sampling_in_flight[request_id] = sampling
                else:
                    del self._sampling_in_flight[request_id]
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            external = self._external.get(request_id)
            if external is not None and external.loaded_this_step:
                external.loaded_this_step = False
                if request_id in failed:
                    self._roll_back_failed_sync_load(request, external)
                    continue
            tokens = result.sampled.get(request_id)
            if not tokens:
                request.num_computed_tokens += num_tokens
                self.kv.cache_computed_blocks(request)
                continue
            drafts = out.spec_token_ids.get(request_id)
            update = RequestUpdate(request)
            reason = None
            for token in tokens:
                request.append_output_token(token.token_id)
                update.tokens.append(token)
                reason = self._stop_reason(request, token.token_id)
                if reason is not None:
                    break
            if drafts and self.speculator is not None:
                # The target kept len(tokens) - 1 drafts and sampled one token after them; a
                # stop among them ends the count there (nothing after it reaches the user).
                self.speculator.record(request_id, len(drafts), min(len(tokens) - 1, len(update.tokens)))
            # The KV now valid: the chunk's, up to the last token kept. That cap is the whole
            # rollback of rejected drafts: their slots are written again next step, and the
            # blocks holding them are neither published nor hashed until then.
            request.num_computed_tokens = min(request.num_computed_tokens + num_tokens, request.num_tokens - 1)
            if self.constraints is not None and reason is None:
                reason = self._follow_grammar(request, update)
            self.kv.update_block_hashes(request)
            self.kv.cache_computed_blocks(request)
            if reason is not None:
                update.finished = self._finish(request, reason)
            else:
                request.spec_token_ids = result.draft_token_ids.get(request_id, [])
            updates.append(update)
        if self.speculator is not None and result.draft_forward_seconds:
            self.speculator.observe_draft(result.draft_forward_seconds)
        if connector_output is not None:
            self._apply_connector_output(connector_output)
        return updates

    def _follow_grammar(self, request: Request, update: RequestUpdate) -> RequestStatus | None:
        """Advance a constrained request's matcher over its new tokens; append the tokens the
        grammar forces next (jump-forward: computed with the next step's token, never sampled).
        A finish reason when the grammar has ended the output or refused a token."""
        constraints = self.constraints
        assert constraints is not None
        verdict = constraints.accept(request)
        if verdict is None:
            params = request.sampling_params
            limit = self.max_model_len - request.num_tokens - 1
            if params.max_tokens is not None:
                limit = min(limit, params.max_tokens - request.num_output_tokens)
            if params.logprobs is not None:
                limit = 0  # a forced token has no distribution to report
            forced = constraints.forced_tokens(request, limit)
            for token_id in forced:
                request.append_output_token(token_id)
                update.tokens.append(SampledToken(token_id))
                reason = self._stop_reason(request, token_id)
                if reason is not None:
                    constraints.accept(request)
                    return reason
            if forced:
                verdict = constraints.accept(request)
        if verdict is None:
            return None
        request.stop_reason = None
        if verdict != "stop":
            logger.error("request %s stopped: %s", request.request_id, verdict)
        return RequestStatus.FINISHED_STOPPED

    def _roll_back_failed_sync_load(self, request: Request, external: _ExternalKV) -> None:
        """The forward read KV that never arrived: drop the step's token and start the request
        over from the waiting queue, where it finds its local prefix again (nothing the load
        should have filled was published) and computes the rest."""
        self.running.remove(request)
        self.kv.free(request)
        self._runner.pop(request.request_id, None)  # it is described anew when readmitted
        request.num_computed_tokens = 0
        request.num_cached_tokens = external.num_local_tokens
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        external.loaded = False
        self.stats.num_failed_loads += 1
        self.stats.num_loaded_tokens -= external.num_external_tokens

    def _apply_connector_output(self, output: KVConnectorOutput) -> None:
        if self.connector is None:
            return
        self.connector.update_connector_output(output)
        for request_id in output.finished_loads | output.failed_loads:
            request = self.requests.get(request_id)
            external = self._external.get(request_id)
            if request is None or external is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
                continue
            self._load_done(request, external, ok=request_id not in output.failed_loads)
        for hold_id in output.finished_holds:
            blocks = self._held.pop(hold_id, None)
            if blocks:
                self.kv.release(blocks)

    def _load_done(self, request: Request, external: _ExternalKV, ok: bool) -> None:
        if ok:
            external.loaded = True
            request.num_computed_tokens = external.num_local_tokens + external.num_external_tokens
            self.kv.cache_computed_blocks(request)
            self.stats.num_loaded_tokens += external.num_external_tokens
        else:
            # Its blocks stay allocated; the prompt is computed into them.
            request.num_computed_tokens = external.num_local_tokens
            self.stats.num_failed_loads += 1
        request.status = RequestStatus.WAITING

    def _give_up_late_loads(self) -> None:
        if self.connector is None:
            return
        for request_id in self.connector.timed_out_loads(time.monotonic()):
            request = self.requests.get(request_id)
            external = self._external.get(request_id)
            if request is not None and external is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                self.stats.num_timed_out_loads += 1
                self._load_done(request, external, ok=False)

    def loaded_tokens(self, request_id: str) -> int:
        """Prompt tokens of a request whose KV a connector supplied (0 if none or it failed)."""
        external = self._external.get(request_id)
        return external.num_external_tokens if external is not None and external.loaded else 0

    def release_hold(self, hold_id: str) -> None:
        """Nobody will read a held handoff: let its connector end the hold."""
        if self.connector is not None and hold_id in self._held:
            self.connector.release(hold_id)

    def pending_kv_work(self) -> float | None:
        """Seconds until the connectors' worker sides should be polled, or None."""
        return None if self.connector is None else self.connector.pending_work()

    def _stop_reason(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
