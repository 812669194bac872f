"""Token deltas from the engine core → text deltas, per sequence: the one output processor.

This is where text is made, for the API server (in its own process) and for the offline
`LLM` alike: incremental detokenization, stop strings (the engine cannot see text; on a hit
the caller tells it to stop that sequence), logprobs passed through per token, and the
hold-back that keeps a stop string from leaking into a stream before it is complete. What
comes out (text steps) is what a tool-call parser reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.engine.detokenizer import IncrementalDetokenizer, find_stop
from tandem.engine.messages import RequestDelta
from tandem.types import RequestStatus, SamplingParams, TokenLogprob


@dataclass(slots=True)
class SequenceStep:
    """What one sequence adds to the response in one step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[list[TokenLogprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestStep:
    sequences: list[SequenceStep]
    num_cached_tokens: int
    queue_seconds: float | None
    kv_transfer_params: dict[str, Any] | None = None  # a connector's word on the KV (a handoff's handle)
    num_loaded_tokens: int = 0  # prompt tokens whose KV a connector supplied


class SequenceText:
    """One sequence's text so far; decides what may be emitted and when it stops."""

    def __init__(self, tokenizer: Any, index: int, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.index = index
        # No tokenizer (random weights on a bare config.json): token ids only, no text.
        self.detokenizer = (None if tokenizer is None
                            else IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                   params.preserved_token_ids))
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

    @property
    def shown_text(self) -> str:
        """The text emitted so far (what a client of this sequence has seen)."""
        return self.text[:self.emitted]

    def prime(self, token_ids: list[int], emit: bool, streamed_from: int | None = None) -> None:
        """Tokens generated elsewhere: context for detokenization and stop strings, whose text
        reaches the client only if `emit`.

        A prefill worker's first token was shown in full. A stream moved here from a broken
        worker (`streamed_from`: where its streamed tokens start) showed its text only up to
        that worker's hold-back, as `add` would have: the held-back tail is still to send.
        """
        shown = len(token_ids) if streamed_from is None else streamed_from
        for token_id in token_ids[:shown]:
            self.num_tokens += 1
            self._append(self._detokenize(token_id))
        if not emit:
            self.emitted = len(self.text)
        for token_id in token_ids[shown:]:
            self.num_tokens += 1
            self._append(self._detokenize(token_id))
        if not emit and not self.finished:
            self.emitted = max(self.emitted, len(self.text) - self.hold)

    def add(self, token_ids: list[int], logprobs: list[list[TokenLogprob]] | None,
            finish_reason: str | None, stop_reason: int | str | None) -> SequenceStep | None:
        if self.finished:
            return None
        taken = 0
        for token_id in token_ids:
            taken += 1
            self.num_tokens += 1
            if self._append(self._detokenize(token_id)):
                break
        at_end = not self.finished and finish_reason is not None
        if at_end and not self._append(self.detokenizer.flush() if self.detokenizer is not None else ""):
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
        end = len(self.text) if self.finished else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        if not delta and not taken and not self.finished:
            return None
        return SequenceStep(self.index, delta, token_ids[:taken],
                            None if logprobs is None else logprobs[:taken],
                            self.finish_reason, self.stop_reason)

    def _detokenize(self, token_id: int) -> str:
        return "" if self.detokenizer is None else self.detokenizer.add(token_id)

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


class RequestText:
    """One request's n sequences: engine deltas in, text steps out."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams,
                 prior_output_ids: list[int] | None = None, emit_prior: bool = False,
                 streamed_from: int | None = None) -> None:
        self.sequences = [SequenceText(tokenizer, i, prompt_token_ids, params) for i in range(params.n)]
        if prior_output_ids:
            self.sequences[0].prime(prior_output_ids, emit_prior, streamed_from)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def process(self, delta: RequestDelta) -> tuple[RequestStep | None, list[int]]:
        """The text step for one engine delta, and the sequences a stop string just ended
        (the engine does not know yet: tell it to stop them)."""
        steps = []
        stopped = []
        for seq_delta in delta.sequences:
            seq = self.sequences[seq_delta.index]
            was_finished = seq.finished
            step = seq.add(seq_delta.token_ids, seq_delta.logprobs, seq_delta.finish_reason, seq_delta.stop_reason)
            if step is not None:
                steps.append(step)
            if seq.finished and not was_finished and seq_delta.finish_reason is None:
                stopped.append(seq.index)
        if not steps and delta.kv_transfer_params is None and not delta.num_loaded_tokens:
            return None, stopped
        return RequestStep(steps, delta.num_cached_tokens, delta.queue_seconds, delta.kv_transfer_params,
                           delta.num_loaded_tokens), stopped
