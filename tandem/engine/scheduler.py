"""Continuous batching under one token budget per step. Torch-free.

Every step moves each scheduled request's `num_computed_tokens` toward its `num_tokens`:
a decode is one token, a prefill is as many prompt tokens as the budget allows (chunked
prefill). Running requests go first, in arrival order, so decodes are never starved by new
prefills; waiting requests are admitted FCFS with their cached prefix skipped. When blocks run
out, the most recently admitted running request is preempted and later recomputed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from tandem.config import SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.types import Request, RequestStatus, SampledToken


@dataclass
class ScheduledChunk:
    """The slice of one request that runs this step."""

    request: Request
    start: int  # first position computed this step
    num_tokens: int
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """Only a chunk that reaches the end of the known tokens produces a new token."""
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.start + self.num_tokens]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # since the last step (runner state cleanup)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks


@dataclass
class FinishedRequest:
    request: Request
    reason: RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_step: list[str] = []
        self.num_preemptions = 0

    # --- queue management -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not request.num_tokens:
            # A zero-token chunk would count as sampling and read another request's logits.
            raise ValueError("the prompt is empty; give at least one token")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_tokens} tokens; the context is {self.max_model_len}"
            )
        request.status = RequestStatus.WAITING
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

    def _finish(self, request: Request, reason: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = reason
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_since_step.append(request.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # --- one step -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished=self._finished_since_step)
        self._finished_since_step = []
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledChunk] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break
            scheduled.append(self._chunk(request, num_new))
            budget -= num_new
            index += 1

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                computed_blocks, num_cached = self.kv.get_computed_blocks(request)
                num_new = min(request.num_tokens - num_cached, budget)
                if not self.kv.allocate_slots(request, num_new, computed_blocks):
                    break
                self.waiting.popleft()
                request.num_computed_tokens = num_cached
                if request.num_cached_tokens < 0:
                    # First admission only: a recomputation after preemption hits its own
                    # blocks, which says nothing about how well the prefix cache serves prompts.
                    request.num_cached_tokens = num_cached
                    self.kv.record_prefix_lookup(request, num_cached)
                request.status = RequestStatus.RUNNING
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = time.monotonic()
                self.running.append(request)
                scheduled.append(self._chunk(request, num_new))
                budget -= num_new

        out.chunks = scheduled
        return out

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        return ScheduledChunk(
            request=request,
            start=request.num_computed_tokens,
            num_tokens=num_new,
            block_ids=self.kv.block_ids_of(request.request_id),
        )

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, SampledToken]
    ) -> tuple[list[Request], list[FinishedRequest]]:
        """Advance progress after the model ran; returns (requests with a new token, finished)."""
        progressed: list[Request] = []
        finished: list[FinishedRequest] = []
        for chunk in out.chunks:
            request = chunk.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens = chunk.start + chunk.num_tokens
            self.kv.cache_computed_blocks(request)
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_output_token(token.token_id)
            progressed.append(request)
            reason = self._stop_reason(request, token.token_id)
            if reason is not None:
                self._finish(request, reason)
                finished.append(FinishedRequest(request, reason))
        return progressed, finished

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
