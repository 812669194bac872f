"""`/v1/messages` and `/v1/responses` on a worker: a protocol adapter around the chat path.

The adapter (tandem/edge/protocols) turns the body into a chat request; from there the request
is a chat request like any other (`prepare_chat`, the engine, the tool parser), and its reply
or chunks go back through the adapter. Refusals keep their status and take the protocol's
error shape, before the stream starts and in it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from tandem.edge.disconnect import unless_disconnected
from tandem.edge.errors import APIError, validation_error
from tandem.edge.openai_protocol import ChatCompletionRequest
from tandem.edge.protocols.base import (
    ProtocolAdapter,
    StreamTranslator,
    Translated,
    dropped_headers,
    finish_stream,
)
from tandem.server.serving import ServingState, as_api_error
from tandem.server.serving_chat import chat_chunks, chat_reply, observe_chat, prepare_chat


async def read_json(raw: Request) -> dict[str, Any]:
    try:
        body = json.loads(await raw.body())
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", None, "invalid_value")
    return body


def chat_request(translated: Translated) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(translated.chat)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def protocol_error(adapter: ProtocolAdapter, exc: APIError) -> JSONResponse:
    return JSONResponse(adapter.error_body(exc.status, exc.body()), status_code=exc.status, headers=exc.headers)


async def serve_protocol(state: ServingState, adapter: ProtocolAdapter, raw: Request) -> Response:
    try:
        translated = await adapter.to_chat(await read_json(raw), raw.headers)
        body = chat_request(translated)
        run, headers = prepare_chat(state, body, raw)
    except APIError as exc:
        state.metrics.observe_error(exc.status)
        return protocol_error(adapter, exc)
    headers = {**headers, **dropped_headers(translated)}
    if body.stream:
        translator = adapter.stream(translated)
        events = protocol_events(chat_chunks(state, run), translator, lambda: observe_chat(state, run),
                                 lambda: finish_stream(adapter, translated, translator))
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    try:
        reply = await unless_disconnected(raw, chat_reply(state, run))
    except APIError as exc:
        return protocol_error(adapter, exc)
    finally:
        observe_chat(state, run)
    return JSONResponse(await adapter.reply(reply, translated), headers=headers)


async def protocol_events(chunks: AsyncIterator[dict[str, Any]], translator: StreamTranslator,
                          on_end: Callable[[], None],
                          on_close: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[str]:
    """The protocol's events for a run's chunks; a failure after the start is an error event.
    `on_close` (the adapter's `finish`) runs before the closing events go out."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                for event in translator.feed(chunk):
                    yield event
        closing = translator.close()
        if on_close is not None:
            await on_close()
        for event in closing:
            yield event
    except Exception as exc:
        for event in translator.error(as_api_error(exc).body()):
            yield event
        for event in translator.close():
            yield event
    finally:
        on_end()
