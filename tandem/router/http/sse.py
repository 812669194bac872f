"""The router's event-stream response, and a worker's error reply as a stream event.

A streamed answer's status (200) is sent before its hops finish, so whatever goes wrong
later reaches the client as an error event in the stream; `error_payload` makes one in the
OpenAI error shape from whatever a worker answered. The events themselves (`sse`, the
closing `[DONE]`) are written by pd/merge.py, which shapes every chunk.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.edge.errors import error_body


class EventStream(StreamingResponse):
    """An event stream that releases its upstream hop however the response ends.

    A generator's `finally` runs only if the generator started and is closed; when the
    client leaves before the body starts (or while the generator waits at a `yield`),
    Starlette just drops it. Closing it here, shielded from the cancellation, makes the
    worker see its connection close (and abort) at once.
    """

    def __init__(self, body: AsyncIterator[str], cleanup: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                body = self.body_iterator
                if isinstance(body, AsyncGenerator):
                    await body.aclose()
                await self._cleanup()


def error_payload(data: bytes, status: int) -> dict[str, Any]:
    """A worker's error reply as an error event: its own if it is one, else made from it."""
    try:
        payload = json.loads(data)
        if isinstance(payload, dict) and "error" in payload:
            return payload
    except ValueError:
        pass
    return error_body(status, data.decode(errors="replace")[:500] or f"HTTP {status}")
