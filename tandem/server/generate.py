"""One request on the engine core, as an async stream of text steps for a response.

The text itself comes from the engine's one output processor (tandem/engine/output_processor.py);
this adaptor feeds it the core's deltas, tells the core when a stop string ended a sequence,
and keeps the request's timings for the metrics.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.output_processor import RequestStep, RequestText
from tandem.server.engine_client import AsyncEngineClient, Handoff
from tandem.types import CacheRetention, SamplingParams


@dataclass
class RequestTimings:
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    queue_seconds: float | None = None
    inter_token: list[float] = field(default_factory=list)

    def observe(self, queue_seconds: float | None, has_tokens: bool) -> None:
        now = time.monotonic()
        if queue_seconds is not None:
            self.queue_seconds = queue_seconds
        if has_tokens:
            if self.first_token is None:
                self.first_token = now
            elif self.last_token is not None:
                self.inter_token.append(now - self.last_token)
            self.last_token = now


def request_text(tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams,
                 handoff: Handoff | None) -> RequestText:
    """The request's text state, primed with the output another worker generated."""
    if handoff is None:
        return RequestText(tokenizer, prompt_token_ids, params)
    return RequestText(tokenizer, prompt_token_ids, params, handoff.prior_output_ids, handoff.emit_prior,
                       handoff.streamed_from)


async def process_request(
    client: AsyncEngineClient, tokenizer: Any, request_id: str, prompt_token_ids: list[int],
    params: SamplingParams, timings: RequestTimings, handoff: Handoff | None = None,
    cache_salt: str | None = None, retention: CacheRetention | None = None,
) -> AsyncIterator[RequestStep]:
    """Run one request on the engine and yield its text steps until every sequence is done."""
    text = request_text(tokenizer, prompt_token_ids, params, handoff)
    async with aclosing(client.generate(request_id, prompt_token_ids, params, handoff, cache_salt, retention)) as deltas:
        async for delta in deltas:
            timings.observe(delta.queue_seconds, any(s.token_ids for s in delta.sequences))
            step, stopped = text.process(delta)
            for index in stopped:
                client.finish_sequence(request_id, index)  # a stop string: the engine can't see it
            if step is not None:
                yield step
            if text.finished:
                return  # closing `deltas` aborts whatever the engine still runs for this request
