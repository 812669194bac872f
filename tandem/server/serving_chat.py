"""`POST /v1/chat/completions`: validate, render, run, and answer whole or as SSE chunks."""

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
from tandem.edge.limits import check_shape
from tandem.edge.openai_protocol import ChatCompletionRequest
from tandem.server.cache_retention import chat_retention
from tandem.server.chat_output import SequenceOutput
from tandem.server.chat_prompt import ChatPrompt, render_chat_prompt, tool_choice_name
from tandem.server.engine_client import Handoff
from tandem.server.generate import RequestTimings, process_request, request_text
from tandem.server.reasoning import ReasoningParser
from tandem.server.serving import (
    ServingState,
    sse,
    sse_events,
    usage,
)
from tandem.server.structured_output import after_reasoning, requested_constraint, tool_constraint
from tandem.server.tool_parsers import ToolParser
from tandem.trust.access import is_peer
from tandem.types import CacheRetention, SamplingParams, TokenLogprob


@dataclass
class ChatRun:
    """Everything about one accepted chat request that the response needs."""

    request_id: str
    model: str
    prompt: ChatPrompt
    prompt_token_ids: list[int]
    params: SamplingParams
    parser: ToolParser | None
    want_logprobs: bool
    include_usage: bool
    single_call: bool
    handoff: Handoff | None = None
    cache_salt: str | None = None
    return_token_ids: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    timings: RequestTimings = field(default_factory=RequestTimings)
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    breakpoint_tokens: int | None = None  # prompt tokens up to the last cache_control breakpoint
    retention: CacheRetention | None = None  # that prefix kept cached ahead of others for its TTL
    reasoning: ReasoningParser | None = None  # the server's --reasoning-parser

    def output(self) -> SequenceOutput:
        """A fresh parser pipeline for one sequence of this run's output."""
        return SequenceOutput.start(self.prompt.text, self.prompt.forced_prefix, self.reasoning, self.parser,
                                    self.prompt.tool_names)

    def usage(self) -> dict[str, Any]:
        """Chat usage; with a cache breakpoint, the tokens written up to it that were not read
        from the cache (`prompt_tokens_details.cache_write_tokens`)."""
        out = usage(len(self.prompt_token_ids), self.completion_tokens, self.cached_tokens)
        if self.breakpoint_tokens is not None:
            written = max(0, self.breakpoint_tokens - self.cached_tokens)
            out["prompt_tokens_details"]["cache_write_tokens"] = written
        return out


async def create_chat_completion(state: ServingState, body: ChatCompletionRequest, raw: Request) -> Response:
    run, headers = prepare_chat(state, body, raw)
    if body.stream:
        return StreamingResponse(sse_events(_sse(chat_chunks(state, run)), lambda: observe_chat(state, run)),
                                 media_type="text/event-stream", headers=headers)
    try:
        return JSONResponse(await unless_disconnected(raw, chat_reply(state, run)), headers=headers)
    finally:
        observe_chat(state, run)


def prepare_chat(state: ServingState, body: ChatCompletionRequest, raw: Request) -> tuple[ChatRun, dict[str, str]]:
    """Check, render and admit a chat request: its run and the response headers it needs.

    Every protocol comes through here (tandem/edge/protocols translate the others into a chat
    request first); once this returns, the request holds its admission until `observe_chat`."""
    model = state.check_model(body.model)
    check_shape({"messages": body.messages, "tools": body.tools or []}, state.config.limits)
    guided = requested_constraint(body)
    tool_grammar = tool_constraint(state, body)
    if guided is not None and tool_grammar is not None:
        raise bad_request("response_format cannot be combined with a tool_choice that forces calls or with strict "
                          "tools: the output is either a call or the format", "response_format", "invalid_value")
    try:
        logprobs = body.num_logprobs()
    except ValueError as exc:
        raise bad_request(str(exc), "top_logprobs", "invalid_value") from exc
    prompt = render_chat_prompt(state.tokenizer, body.messages, body.tools, body.tool_choice,
                                state.tool_parser, body.add_generation_prompt, body.continue_final_message,
                                body.chat_template_kwargs, prefix_forces_calls=tool_grammar is None)
    token_ids = state.encode(prompt.text, add_special_tokens=False)
    max_tokens = state.check_prompt(token_ids, body.requested_max_tokens(), "messages")
    headers = state.max_tokens_headers(body.requested_max_tokens(), max_tokens)
    params = state.sampling_params(body, max_tokens, logprobs)
    params.guided = after_reasoning(state, guided or tool_grammar, prompt.text)
    single_call = body.parallel_tool_calls is False or tool_choice_name(body.tool_choice) is not None
    if prompt.tools_enabled:
        params.preserved_token_ids = state.preserved_token_ids()
    if prompt.tools_enabled and single_call:
        # One call is all that is wanted: stop decoding when it closes.
        params.stop = [*params.stop, *state.tool_parser.stop_strings(parallel_tool_calls=False)]
    handoff = state.handoff(body.kv_transfer_params, params, body.stream, is_peer(raw))
    request_id = state.new_id("chatcmpl")
    breakpoint_tokens = cache_breakpoint_tokens(state, body, prompt, token_ids)
    state.check_admission([request_id], params.n, [len(token_ids)])
    run = ChatRun(
        request_id=request_id, model=model, prompt=prompt, prompt_token_ids=token_ids,
        params=params, parser=state.tool_parser if prompt.tools_enabled else None,
        want_logprobs=logprobs is not None,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        single_call=single_call,
        handoff=handoff,
        cache_salt=body.cache_salt,
        return_token_ids=body.return_token_ids,
        completion_tokens=len(handoff.prior_output_ids) if handoff else 0,
        breakpoint_tokens=breakpoint_tokens,
        retention=chat_retention(body.messages, breakpoint_tokens),
        reasoning=state.reasoning_parser,
    )
    return run, headers


def cache_breakpoint_tokens(state: ServingState, body: ChatCompletionRequest, prompt: ChatPrompt,
                            token_ids: list[int]) -> int | None:
    """How many prompt tokens lie up to the last `cache_control` breakpoint (None: no breakpoint).

    The conversation up to the marked message is rendered on its own; the tokens it shares
    with the whole prompt are the prefix the breakpoint covers (a template may close a turn
    differently when nothing follows it, so only the common part counts)."""
    last = max((i for i, m in enumerate(body.messages) if m.has_cache_breakpoint()), default=None)
    if last is None:
        return None
    if last == len(body.messages) - 1:
        return len(token_ids)
    head = render_chat_prompt(state.tokenizer, body.messages[:last + 1], body.tools, body.tool_choice,
                              state.tool_parser, add_generation_prompt=False, continue_final_message=False,
                              template_kwargs=body.chat_template_kwargs)
    head_ids = state.encode(head.text, add_special_tokens=False)
    shared = 0
    for a, b in zip(head_ids, token_ids, strict=False):
        if a != b:
            break
        shared += 1
    return shared


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async with aclosing(chunks):
        async for chunk in chunks:
            yield sse(chunk)


def _finish_reason(reason: str | None, called_tools: bool) -> str | None:
    return "tool_calls" if reason == "stop" and called_tools else reason


async def chat_reply(state: ServingState, run: ChatRun) -> dict[str, Any]:
    """The whole `chat.completion` of an admitted run."""
    n = run.params.n
    texts = [""] * n
    entries: list[list[list[TokenLogprob]]] = [[] for _ in range(n)]
    finish: list[tuple[str | None, int | str | None]] = [(None, None)] * n
    token_ids: list[int] = []
    kv_transfer, loaded = None, 0
    async with aclosing(process_request(state.client, state.tokenizer, run.request_id, run.prompt_token_ids,
                                        run.params, run.timings, run.handoff, run.cache_salt,
                                        run.retention)) as steps:
        async for step in steps:
            run.cached_tokens = step.num_cached_tokens
            kv_transfer = step.kv_transfer_params or kv_transfer
            loaded = step.num_loaded_tokens or loaded
            for seq in step.sequences:
                if seq.index == 0:
                    token_ids.extend(seq.token_ids)
                texts[seq.index] += seq.text
                run.completion_tokens += len(seq.token_ids)
                if seq.logprobs:
                    entries[seq.index].extend(seq.logprobs)
                if seq.finish_reason is not None:
                    finish[seq.index] = (seq.finish_reason, seq.stop_reason)
    choices = []
    for index in range(n):
        reason, stop_reason = finish[index]
        output = run.output()
        whole = output.feed(texts[index], final=True)
        message: dict[str, Any] = {"role": "assistant", "content": whole.content}
        if run.reasoning is not None:
            message["reasoning_content"] = whole.reasoning or None
        if run.parser is not None:
            calls = whole.tool_calls[:1] if run.single_call else whole.tool_calls
            # None beside calls (as OpenAI does), "" for a blank answer without them.
            content = whole.content if whole.content.strip() else None
            message["content"] = content if calls else (content or "")
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
            reason = _finish_reason(reason, bool(calls))
        run.finish_reasons.append(reason or "abort")
        choices.append({
            "index": index,
            "message": message,
            "logprobs": {"content": state.chat_logprobs(entries[index])} if run.want_logprobs else None,
            "finish_reason": reason,
            "stop_reason": stop_reason,
        })
    body = {
        "id": run.request_id,
        "object": "chat.completion",
        "created": run.created,
        "model": run.model,
        "choices": choices,
        "usage": run.usage(),
    }
    if run.handoff is not None:
        body["kv_transfer_params"] = state.handoff_reply(run.handoff, kv_transfer, finish[0][0], token_ids, loaded)
    return body


async def chat_chunks(state: ServingState, run: ChatRun) -> AsyncIterator[dict[str, Any]]:
    """The `chat.completion.chunk`s of an admitted run, as dicts (the caller writes them out)."""
    n = run.params.n

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        payload: dict[str, Any] = {"id": run.request_id, "object": "chat.completion.chunk",
                                   "created": run.created, "model": run.model, "choices": choices}
        if run.include_usage:
            payload["usage"] = None
        return payload

    outputs = [run.output() for _ in range(n)]
    if run.handoff is not None and not run.handoff.emit_prior:
        # A stream moved here: the client has this much of the output already. Its parsers
        # read it (and what they say was said) so that they go on where the others stopped.
        shown = request_text(state.tokenizer, run.prompt_token_ids, run.params, run.handoff).sequences[0]
        outputs[0].feed(shown.shown_text)
    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(n)])
    async with aclosing(process_request(state.client, state.tokenizer, run.request_id,
                                        run.prompt_token_ids, run.params, run.timings,
                                        run.handoff, run.cache_salt, run.retention)) as steps:
        async for step in steps:
            run.cached_tokens = step.num_cached_tokens
            choices = []
            for seq in step.sequences:
                run.completion_tokens += len(seq.token_ids)
                delta: dict[str, Any] = {}
                reason = seq.finish_reason
                output = outputs[seq.index]
                pieces = output.feed(seq.text, final=reason is not None)
                if pieces.reasoning:
                    delta["reasoning_content"] = pieces.reasoning
                if pieces.content:
                    delta["content"] = pieces.content
                calls = [c for c in pieces.tool_calls if not run.single_call or c.index == 0]
                if calls:
                    delta["tool_calls"] = [c.to_openai() for c in calls]
                if run.parser is not None:
                    reason = _finish_reason(reason, output.called_tools)
                logprobs = None
                extra: dict[str, Any] = {}
                if run.want_logprobs and seq.logprobs:
                    logprobs = {"content": state.chat_logprobs(seq.logprobs)}
                if reason is not None:
                    run.finish_reasons.append(reason)
                    if seq.stop_reason is not None:  # the stop string or token that ended it (vLLM's)
                        extra["stop_reason"] = seq.stop_reason
                if run.return_token_ids and seq.token_ids:
                    # Every token is reported, held-back text or not: the ids are the record.
                    choices.append({"index": seq.index, "delta": delta, "logprobs": logprobs,
                                    "finish_reason": reason, **extra, "token_ids": seq.token_ids})
                elif delta or reason is not None or logprobs is not None:
                    choices.append({"index": seq.index, "delta": delta, "logprobs": logprobs,
                                    "finish_reason": reason, **extra})
            if choices:
                yield chunk(choices)
    if run.include_usage:
        yield {"id": run.request_id, "object": "chat.completion.chunk", "created": run.created,
               "model": run.model, "choices": [], "usage": run.usage()}


def observe_chat(state: ServingState, run: ChatRun) -> None:
    """The run's metrics, once, however it ended; and its admission given back if unused."""
    state.client.unreserve([run.request_id])  # if it never reached the engine
    state.metrics.observe_finished(run.timings, time.monotonic(), len(run.prompt_token_ids), run.cached_tokens,
                                   run.completion_tokens, run.finish_reasons or ["abort"])
