"""ProtocolErrorShape: a refusal on /v1/messages reaches the client in Anthropic's shape,
whether a route or a middleware in front of it wrote it; nothing else changes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.edge.errors import error_body
from tandem.edge.protocols.error_shape import ProtocolErrorShape, agent_protocol_shapes


class Refuse:
    """A middleware that refuses `/v1/*` with a 401 in OpenAI's shape, as the key check does."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers") or [])
        if scope["type"] == "http" and b"x-refuse" in headers:
            reply = JSONResponse(error_body(401, "Incorrect API key provided", None, "invalid_api_key"), 401)
            await reply(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _ok(_: Any) -> JSONResponse:
    return JSONResponse({"type": "message", "content": []})


async def _openai_error(_: Any) -> JSONResponse:
    return JSONResponse(error_body(429, "slow down", None, "rate_limited"), 429, headers={"retry-after": "3"})


async def _anthropic_error(_: Any) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}, 529)


async def _stream(_: Any) -> StreamingResponse:
    async def events() -> Any:
        for i in range(3):
            yield f"event: ping\ndata: {{\"i\": {i}}}\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


async def _big(_: Any) -> JSONResponse:
    return JSONResponse({"error": {"message": "x" * 100_000}}, 400)


async def _text_error(_: Any) -> PlainTextResponse:
    return PlainTextResponse("plain", 500)


def _app() -> ProtocolErrorShape:
    routes = [
        Route("/v1/messages", _ok, methods=["POST"]),
        Route("/v1/messages/count_tokens", _openai_error, methods=["POST"]),
        Route("/v1/messages/busy", _anthropic_error, methods=["POST"]),
        Route("/v1/messages/stream", _stream, methods=["POST"]),
        Route("/v1/messages/big", _big, methods=["POST"]),
        Route("/v1/messages/text", _text_error, methods=["POST"]),
        Route("/v1/chat/completions", _openai_error, methods=["POST"]),
        Route("/v1/messagesque", _openai_error, methods=["POST"]),
    ]
    return ProtocolErrorShape(Refuse(Starlette(routes=routes)), agent_protocol_shapes())


def _post(path: str, **headers: str) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, json={}, headers=headers)
    return asyncio.run(go())


def test_a_middlewares_refusal_on_messages_is_in_anthropic_shape() -> None:
    reply = _post("/v1/messages", **{"x-refuse": "1"})
    assert reply.status_code == 401
    assert reply.json() == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "Incorrect API key provided"}}
    assert int(reply.headers["content-length"]) == len(reply.content)


def test_a_routes_openai_error_is_reshaped_and_keeps_its_headers() -> None:
    reply = _post("/v1/messages/count_tokens")
    assert reply.status_code == 429 and reply.headers["retry-after"] == "3"
    assert reply.json() == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}


def test_what_is_not_an_openai_error_on_messages_passes_untouched() -> None:
    assert _post("/v1/messages").json() == {"type": "message", "content": []}
    busy = _post("/v1/messages/busy")
    assert busy.status_code == 529 and busy.json()["error"]["type"] == "overloaded_error"
    stream = _post("/v1/messages/stream")
    assert stream.text.count("event: ping") == 3
    big = _post("/v1/messages/big")
    assert big.status_code == 400 and len(big.json()["error"]["message"]) == 100_000
    text = _post("/v1/messages/text")
    assert text.status_code == 500 and text.text == "plain"


def test_other_paths_keep_openais_shape() -> None:
    for path in ("/v1/chat/completions", "/v1/messagesque"):
        reply = _post(path)
        assert reply.status_code == 429 and json.loads(reply.content)["error"]["code"] == "rate_limited"
    refused = _post("/v1/chat/completions", **{"x-refuse": "1"})
    assert refused.json()["error"]["code"] == "invalid_api_key"
