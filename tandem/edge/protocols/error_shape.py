"""Refusals on a protocol's paths in that protocol's error shape, whoever made them.

The Messages routes answer their own errors in Anthropic's shape (`serving_protocol`, the
router's `protocol`), but some refusals happen before a route runs: the API-key middleware's
401, the request limits' 413 / 408 / 429, the access policy's 403, a 404 for a path under
`/v1/messages` that does not exist, a drain's 503. Each is written once, in OpenAI's shape, for
every path. This middleware sits outside all of them and rewrites a JSON error on a path a
protocol owns into that protocol's shape, so an Anthropic client always reads
`{"type": "error", "error": {"type", "message"}}` and no refusal needs to know which client
asked. Bodies already in the protocol's shape, successes and streams pass untouched.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.edge.protocols import anthropic_reply

# An OpenAI error body and its status → the protocol's error body.
Reshape = Callable[[int, dict[str, Any]], dict[str, Any]]

# An error body is small; anything larger is not one of ours and passes as it is.
_MAX_ERROR_BYTES = 64 * 1024


def agent_protocol_shapes() -> dict[str, Reshape]:
    """The paths whose errors are not OpenAI's: the Messages API's (Responses errors are)."""
    return {"/v1/messages": anthropic_reply.error_body}


class ProtocolErrorShape:
    """Plain ASGI middleware: `shapes` maps a path prefix to the reshape for its protocol."""

    def __init__(self, app: ASGIApp, shapes: Mapping[str, Reshape]) -> None:
        self.app = app
        self.shapes = dict(shapes)

    def _shape_for(self, path: str) -> Reshape | None:
        for prefix, reshape in self.shapes.items():
            if path == prefix or path.startswith(prefix + "/"):
                return reshape
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        reshape = self._shape_for(scope["path"]) if scope["type"] == "http" else None
        if reshape is None:
            await self.app(scope, receive, send)
            return
        held: Message | None = None
        body = bytearray()
        passing = True

        async def reshaping_send(message: Message) -> None:
            nonlocal held, passing
            if message["type"] == "http.response.start":
                headers = MutableHeaders(raw=message["headers"])
                is_json = headers.get("content-type", "").startswith("application/json")
                passing = not (message["status"] >= 400 and is_json)
                if passing:
                    await send(message)
                else:
                    held = message
                return
            if passing or message["type"] != "http.response.body":
                await send(message)
                return
            body.extend(message.get("body", b""))
            if len(body) > _MAX_ERROR_BYTES:  # not an error body of ours: let it through as it is
                passing = True
                assert held is not None
                await send(held)
                await send({**message, "body": bytes(body)})
                return
            if message.get("more_body", False):
                return
            assert held is not None
            out = _reshaped(bytes(body), held["status"], reshape)
            headers = MutableHeaders(raw=held["headers"])
            headers["content-length"] = str(len(out))
            await send(held)
            await send({"type": "http.response.body", "body": out, "more_body": False})

        await self.app(scope, receive, reshaping_send)


def _reshaped(body: bytes, status: int, reshape: Reshape) -> bytes:
    try:
        parsed = json.loads(body)
    except ValueError:
        return body
    if not isinstance(parsed, dict) or "error" not in parsed or parsed.get("type") == "error":
        return body  # not an OpenAI error (or already the protocol's)
    return json.dumps(reshape(status, parsed), ensure_ascii=False).encode()
