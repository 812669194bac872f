"""Request limits for the worker's and the router's HTTP servers: body size, slow bodies, and
how many messages and tools one request may carry.

A body larger than `max_body_bytes` gets a 413 before it is read (its Content-Length says so)
or as soon as it grows past the limit; a body that has not fully arrived `body_timeout_s`
after the request began gets a 408, so a client trickling bytes cannot hold a connection and
a request slot for ever. Both answers are OpenAI-shaped. The body is read here, once, and
handed to the app as it came (FastAPI reads whole JSON bodies anyway).

A JSON body holding a lone UTF-16 surrogate (`"\\ud800"` not followed by its low half)
gets a 400 here too: Python's json decodes it into a str that cannot be encoded as UTF-8,
and the tokenizer, the router's forwarding and the response encoders all failed on it with
a 500. Bodies that are not JSON are left to the app.

Message and tool counts are checked where the JSON is parsed (`check_shape`): each message
and tool is rendered into the prompt and tokenized, so their number bounds work done before
the context-length check can refuse the request.

uvicorn bounds the rest: headers (h11's 16 KiB incomplete-event limit) and idle keep-alive
connections (5 s). It does not time out a client that sends its headers slowly.

Imports Starlette and argparse only: the router must not import the engine.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.config import RequestLimits
from tandem.edge.errors import APIError, error_body


def check_shape(body: dict[str, Any], limits: RequestLimits) -> None:
    """400 when a request carries more messages or tools than the limits allow."""
    for field, limit in (("messages", limits.max_messages), ("tools", limits.max_tools)):
        value = body.get(field)
        if isinstance(value, list) and len(value) > limit:
            raise APIError(
                400,
                f"'{field}' holds {len(value)} entries; this server takes at most {limit}",
                field,
                "too_many_entries",
            )


# A \\uXXXX escape of a surrogate (D800-DFFF): the cheap test every body gets; only a body
# that has one (or raw bytes that are not UTF-8) is parsed to look closer.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def holds_lone_surrogate(body: bytes) -> bool:
    """Whether `body`, parsed as JSON the way the app parses it (json.loads), holds a string
    (a key or a value) that is not valid Unicode: a lone surrogate. A valid pair decodes to
    one character and passes; a body that is not JSON is not this function's business."""
    if not _SURROGATE_ESCAPE.search(body):
        if body.isascii():
            return False
        try:
            body.decode("utf-8")
            return False
        except UnicodeDecodeError:
            pass  # json.loads decodes with surrogatepass: raw surrogate bytes get through
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return False
    stack = [parsed]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str, close: bool = True) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.close = close  # the body was not read to its end: the connection cannot be reused


def replaying(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands an app the body already read, whole, then goes on to `receive`
    (a middleware that read the body to check it passes it on this way)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class RequestLimitMiddleware:
    """Plain ASGI: reads a request's body under the size and time limits, then replays it."""

    def __init__(self, app: ASGIApp, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
            if holds_lone_surrogate(body):
                raise _Refused(400, "the request body is not valid Unicode: it holds a lone UTF-16 surrogate "
                                    "(a \\ud800-\\udfff escape that is not half of a pair)", "invalid_unicode",
                               close=False)
        except _Refused as refused:
            response = JSONResponse(
                error_body(refused.status, refused.message, None, refused.code),
                status_code=refused.status,
                headers={"Connection": "close"} if refused.close else None,
            )
            await response(scope, receive, send)
            return
        except _ClientLeft:
            return
        await self.app(scope, replaying(body, receive), send)

    async def _read(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.limits.max_body_bytes
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _too_large(int(length), limit)
        deadline = time.monotonic() + self.limits.body_timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    message = await receive()
            except TimeoutError:
                raise _Refused(
                    408,
                    f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                    "body_timeout",
                ) from None
            if message["type"] == "http.disconnect":
                raise _ClientLeft
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _ClientLeft(Exception):
    pass


def _too_large(size: int, limit: int) -> _Refused:
    return _Refused(
        413,
        f"the request body is {size} bytes or more; this server takes at most {limit} bytes",
        "request_too_large",
    )
