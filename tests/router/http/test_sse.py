"""The router's event-stream response and its error events, without processes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from tandem.router.http.sse import EventStream, error_payload


def test_a_stream_the_client_leaves_closes_its_body_and_runs_its_cleanup() -> None:
    """The client disconnects while the body waits at a `yield` (its socket is slow to take
    the first event): the body's `finally` (which closes the worker's hop) and the cleanup
    (which finishes the call) both run at once, not when the generator is collected."""
    events: list[str] = []
    sent: list[dict] = []
    body_sent = asyncio.Event()

    async def body() -> AsyncIterator[str]:
        try:
            yield "data: one\n\n"
            yield "data: two\n\n"
        finally:
            events.append("body closed")

    async def cleanup() -> None:
        events.append("cleanup")

    async def receive() -> dict:
        await body_sent.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message.get("body"):
            body_sent.set()
            await asyncio.Event().wait()  # the client never takes it; then it disconnects

    async def run() -> None:
        scope = {"type": "http", "asgi": {"spec_version": "2.0"}, "method": "POST", "path": "/"}
        await asyncio.wait_for(EventStream(body(), cleanup)(scope, receive, send), 10)

    asyncio.run(run())
    assert events == ["body closed", "cleanup"]
    assert sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m.get("body") for m in sent[1:] if m.get("body")] == [b"data: one\n\n"]


def test_a_worker_error_reply_becomes_an_openai_error_event() -> None:
    own = {"error": {"message": "too long", "type": "invalid_request_error", "code": 400}}
    assert error_payload(json.dumps(own).encode(), 400) == own
    made = error_payload(b"upstream exploded", 502)
    assert made["error"]["message"] == "upstream exploded" and made["error"]["type"] == "server_error"
    assert error_payload(b"", 503)["error"]["message"] == "HTTP 503"
