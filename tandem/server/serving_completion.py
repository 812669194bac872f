"""`POST /v1/completions`: one or many prompts (text or token ids), whole or streamed.

Each prompt is its own engine request; they run concurrently and their choices are
numbered prompt-major (`prompt_index * n + i`), as OpenAI numbers them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.edge.disconnect import unless_disconnected
from tandem.edge.errors import bad_request
from tandem.edge.openai_protocol import CompletionRequest
from tandem.engine.output_processor import RequestStep
from tandem.server.engine_client import Handoff
from tandem.server.generate import RequestTimings, process_request
from tandem.server.serving import (
    ServingState,
    merge,
    sse,
    sse_events,
    usage,
)
from tandem.server.structured_output import requested_constraint
from tandem.trust.access import is_peer
from tandem.types import SamplingParams, TokenLogprob


@dataclass
class _Prompt:
    request_id: str
    text: str | None
    token_ids: list[int]
    timings: RequestTimings = field(default_factory=RequestTimings)
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class _CompletionRun:
    request_id: str
    model: str
    prompts: list[_Prompt]
    params: SamplingParams
    echo: bool
    want_logprobs: bool
    include_usage: bool
    handoff: Handoff | None = None
    cache_salt: str | None = None
    return_token_ids: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    finish_reasons: list[str] = field(default_factory=list)


async def create_completion(state: ServingState, body: CompletionRequest, raw: Request) -> Response:
    model = state.check_model(body.model)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix", "unsupported")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of other than n is not supported", "best_of", "unsupported")
    try:
        prompts = body.prompts()
        logprobs = body.num_logprobs()
    except ValueError as exc:
        raise bad_request(str(exc), "prompt" if "prompt" in str(exc) else "logprobs", "invalid_value") from exc
    request_id = state.new_id("cmpl")
    runs: list[_Prompt] = []
    max_tokens: int | None = None
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            token_ids, text = state.encode(prompt, add_special_tokens=True), prompt
        else:
            token_ids, text = list(prompt), None
        allowed = state.check_prompt(token_ids, body.max_tokens, "prompt")
        max_tokens = allowed if max_tokens is None else min(max_tokens, allowed)
        runs.append(_Prompt(f"{request_id}-{index}", text, token_ids))
    assert max_tokens is not None
    headers = state.max_tokens_headers(body.max_tokens, max_tokens)
    params = state.sampling_params(body, max_tokens, logprobs)
    params.guided = requested_constraint(body)
    handoff = state.handoff(body.kv_transfer_params, params, body.stream, is_peer(raw))
    if handoff is not None and len(runs) != 1:
        raise bad_request("a prefill/decode handoff takes one prompt", "kv_transfer_params", "invalid_value")
    state.check_admission([p.request_id for p in runs], params.n, [len(p.token_ids) for p in runs])
    run = _CompletionRun(request_id, model, runs, params, body.echo, logprobs is not None,
                         bool(body.stream_options and body.stream_options.include_usage), handoff,
                         cache_salt=body.cache_salt, return_token_ids=body.return_token_ids)
    if handoff is not None:
        runs[0].completion_tokens = len(handoff.prior_output_ids)
    if body.stream:
        return StreamingResponse(sse_events(_stream(state, run), lambda: _observe(state, run)),
                                 media_type="text/event-stream", headers=headers)
    try:
        return JSONResponse(await unless_disconnected(raw, _complete(state, run)), headers=headers)
    finally:
        _observe(state, run)


def _steps(state: ServingState, run: _CompletionRun) -> AsyncIterator[tuple[int, RequestStep]]:
    return merge([process_request(state.client, state.tokenizer, p.request_id, p.token_ids, run.params, p.timings,
                                  run.handoff, run.cache_salt) for p in run.prompts])


def _echo(state: ServingState, prompt: _Prompt) -> str:
    return prompt.text if prompt.text is not None else state.tokenizer.decode(prompt.token_ids)


class _LogprobBuilder:
    """OpenAI's legacy completion logprobs: parallel lists plus character offsets."""

    def __init__(self, state: ServingState, start_offset: int) -> None:
        self.state = state
        self.offset = start_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top: list[dict[str, float]] = []
        self.text_offset: list[int] = []

    def add(self, entries: list[list[TokenLogprob]]) -> None:
        for entry in entries:
            text = self.state.token_text(entry[0].token_id)
            self.tokens.append(text)
            self.token_logprobs.append(max(entry[0].logprob, -9999.0))
            self.top.append({self.state.token_text(t.token_id): max(t.logprob, -9999.0) for t in entry[1:]})
            self.text_offset.append(self.offset)
            self.offset += len(text)

    def body(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top,
                "text_offset": self.text_offset}


async def _complete(state: ServingState, run: _CompletionRun) -> dict[str, Any]:
    n = run.params.n
    total = len(run.prompts) * n
    texts = [""] * total
    builders = [_LogprobBuilder(state, 0) for _ in range(total)]
    finish: list[tuple[str | None, int | str | None]] = [(None, None)] * total
    token_ids: list[int] = []
    kv_transfer, loaded = None, 0
    async with aclosing(_steps(state, run)) as steps:
        async for prompt_index, step in steps:
            prompt = run.prompts[prompt_index]
            prompt.cached_tokens = step.num_cached_tokens
            kv_transfer = step.kv_transfer_params or kv_transfer
            loaded = step.num_loaded_tokens or loaded
            for seq in step.sequences:
                if prompt_index == 0 and seq.index == 0:
                    token_ids.extend(seq.token_ids)
                choice = prompt_index * n + seq.index
                texts[choice] += seq.text
                prompt.completion_tokens += len(seq.token_ids)
                if seq.logprobs:
                    builders[choice].add(seq.logprobs)
                if seq.finish_reason is not None:
                    finish[choice] = (seq.finish_reason, seq.stop_reason)
    choices = []
    for choice in range(total):
        prompt = run.prompts[choice // n]
        text = (_echo(state, prompt) + texts[choice]) if run.echo else texts[choice]
        reason, stop_reason = finish[choice]
        run.finish_reasons.append(reason or "abort")
        choices.append({"index": choice, "text": text,
                        "logprobs": builders[choice].body() if run.want_logprobs else None,
                        "finish_reason": reason, "stop_reason": stop_reason})
    body = {"id": run.request_id, "object": "text_completion", "created": run.created, "model": run.model,
            "choices": choices, "usage": _usage(run)}
    if run.handoff is not None:
        body["kv_transfer_params"] = state.handoff_reply(run.handoff, kv_transfer, finish[0][0], token_ids, loaded)
    return body


def _usage(run: _CompletionRun) -> dict[str, Any]:
    return usage(sum(len(p.token_ids) for p in run.prompts), sum(p.completion_tokens for p in run.prompts),
                 sum(p.cached_tokens for p in run.prompts))


async def _stream(state: ServingState, run: _CompletionRun) -> AsyncIterator[str]:
    n = run.params.n

    def chunk(index: int, text: str, logprobs: dict[str, Any] | None, reason: str | None,
              stop_reason: int | str | None = None, token_ids: list[int] | None = None) -> str:
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                                  "stop_reason": stop_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        payload: dict[str, Any] = {
            "id": run.request_id, "object": "text_completion", "created": run.created, "model": run.model,
            "choices": [choice],
        }
        if run.include_usage:
            payload["usage"] = None
        return sse(payload)

    offsets = [0] * (len(run.prompts) * n)
    if run.echo:
        for prompt_index, prompt in enumerate(run.prompts):
            for i in range(n):
                echoed = _echo(state, prompt)
                offsets[prompt_index * n + i] = len(echoed)
                yield chunk(prompt_index * n + i, echoed, None, None)
    async with aclosing(_steps(state, run)) as steps:
        async for prompt_index, step in steps:
            prompt = run.prompts[prompt_index]
            prompt.cached_tokens = step.num_cached_tokens
            for seq in step.sequences:
                choice = prompt_index * n + seq.index
                prompt.completion_tokens += len(seq.token_ids)
                logprobs = None
                if run.want_logprobs and seq.logprobs:
                    builder = _LogprobBuilder(state, offsets[choice])
                    builder.add(seq.logprobs)
                    offsets[choice] = builder.offset
                    logprobs = builder.body()
                if seq.finish_reason is not None:
                    run.finish_reasons.append(seq.finish_reason)
                if run.return_token_ids and seq.token_ids:
                    # Every token is reported, held-back text or not: the ids are the record.
                    yield chunk(choice, seq.text, logprobs, seq.finish_reason, seq.stop_reason, seq.token_ids)
                elif seq.text or seq.finish_reason is not None or logprobs is not None:
                    yield chunk(choice, seq.text, logprobs, seq.finish_reason, seq.stop_reason)
    if run.include_usage:
        yield sse({"id": run.request_id, "object": "text_completion", "created": run.created,
                   "model": run.model, "choices": [], "usage": _usage(run)})


def _observe(state: ServingState, run: _CompletionRun) -> None:
    state.client.unreserve([p.request_id for p in run.prompts])  # those that never reached the engine
    reasons = iter(run.finish_reasons)
    end = time.monotonic()
    for prompt in run.prompts:
        got = [r for _, r in zip(range(run.params.n), reasons, strict=False)]
        state.metrics.observe_finished(prompt.timings, end, len(prompt.token_ids), prompt.cached_tokens,
                                       prompt.completion_tokens, got or ["abort"])
