"""Token deltas from the engine core → text deltas for a response, per sequence.

This is where text is made, in the server process: incremental detokenization, stop
strings (the engine cannot see text; on a hit we tell it to stop that sequence), and the
hold-back that keeps a stop string from leaking into a stream before it is complete.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.core import RequestDelta
from tandem.engine.detokenizer import IncrementalDetokenizer, find_stop
from tandem.server.engine_client import AsyncEngineClient, Handoff
from tandem.types import RequestStatus, SamplingParams, TokenLogprob


@dataclass
class SequenceStep:
    """What one sequence adds to the response in one step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[list[TokenLogprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestStep:
    sequences: list[SequenceStep]
    num_cached_tokens: int
    queue_seconds: float | None
    kv_transfer: dict[str, Any] | None = None  # the prefill side's handle, on the last step
    kv_adopted_blocks: int = 0


class SequenceText:
    """One sequence's text so far; decides what may be emitted and when it stops."""

    def __init__(self, tokenizer: Any, index: int, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.index = index
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        # Text that may be the start of a stop string waits until it is decided.
        self.hold = 0 if self.include_stop or not self.stops else max(len(s) for s in self.stops) - 1
        self.text = ""
        self.emitted = 0
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def prime(self, token_ids: list[int], emit: bool) -> None:
        """Tokens generated elsewhere (a prefill worker's first token): they are context for
        detokenization and stop strings, and reach the client only if `emit`."""
        for token_id in token_ids:
            self.num_tokens += 1
            self._append(self.detokenizer.add(token_id))
        if not emit:
            self.emitted = len(self.text)

    def add(self, token_ids: list[int], logprobs: list[list[TokenLogprob]] | None,
            finish_reason: str | None, stop_reason: int | str | None) -> SequenceStep | None:
        if self.finished:
            return None
        taken = 0
        for token_id in token_ids:
            taken += 1
            self.num_tokens += 1
            if self._append(self.detokenizer.add(token_id)):
                break
        at_end = not self.finished and finish_reason is not None
        if at_end and not self._append(self.detokenizer.flush()):
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
        end = len(self.text) if self.finished else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        if not delta and not taken and not self.finished:
            return None
        return SequenceStep(self.index, delta, token_ids[:taken],
                            None if logprobs is None else logprobs[:taken],
                            self.finish_reason, self.stop_reason)

    def _append(self, delta: str) -> bool:
        """Add text; True when it completed a stop string (the text is then cut there)."""
        if not delta:
            return False
        self.text += delta
        if not self.stops:
            return False
        hit = find_stop(self.text, len(delta), self.stops)
        if hit is None:
            return False
        index, stop = hit
        self.text = self.text[: index + (len(stop) if self.include_stop else 0)]
        self.emitted = min(self.emitted, len(self.text))
        self.finish_reason, self.stop_reason = RequestStatus.FINISHED_STOPPED.value, stop
        return True


@dataclass
class RequestTimings:
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    queue_seconds: float | None = None
    inter_token: list[float] = field(default_factory=list)


async def process_request(
    client: AsyncEngineClient, tokenizer: Any, request_id: str, prompt_token_ids: list[int],
    params: SamplingParams, timings: RequestTimings, handoff: Handoff | None = None,
) -> AsyncIterator[RequestStep]:
    """Run one request on the engine and yield its text steps until every sequence is done."""
    sequences = [SequenceText(tokenizer, i, prompt_token_ids, params) for i in range(params.n)]
    if handoff is not None and handoff.prior_output_ids:
        sequences[0].prime(handoff.prior_output_ids, handoff.emit_prior)
    async with aclosing(client.generate(request_id, prompt_token_ids, params, handoff)) as deltas:
        async for delta in deltas:
            step = _text_step(client, request_id, sequences, delta, timings)
            if step is None and (delta.kv_transfer is not None or delta.kv_adopted_blocks):
                step = RequestStep([], delta.num_cached_tokens, timings.queue_seconds)
            if step is not None:
                step.kv_transfer = delta.kv_transfer
                step.kv_adopted_blocks = delta.kv_adopted_blocks
                yield step
            if all(s.finished for s in sequences):
                return  # closing `deltas` aborts whatever the engine still runs for this request


def _text_step(client: AsyncEngineClient, request_id: str, sequences: list[SequenceText],
               delta: RequestDelta, timings: RequestTimings) -> RequestStep | None:
    now = time.monotonic()
    if delta.queue_seconds is not None:
        timings.queue_seconds = delta.queue_seconds
    if any(s.token_ids for s in delta.sequences):
        if timings.first_token is None:
            timings.first_token = now
        elif timings.last_token is not None:
            timings.inter_token.append(now - timings.last_token)
        timings.last_token = now
    steps = []
    for seq_delta in delta.sequences:
        seq = sequences[seq_delta.index]
        was_finished = seq.finished
        step = seq.add(seq_delta.token_ids, seq_delta.logprobs, seq_delta.finish_reason, seq_delta.stop_reason)
        if step is not None:
            steps.append(step)
        if seq.finished and not was_finished and seq_delta.finish_reason is None:
            client.finish_sequence(request_id, seq.index)  # a stop string: the engine can't see it
    if not steps:
        return None
    return RequestStep(steps, delta.num_cached_tokens, timings.queue_seconds)
