"""Watching for a client that left while its request waits on slow work.

Starlette tells a handler that its client hung up only when asked (`is_disconnected`), and a
non-streaming request may wait seconds on an engine or an upstream worker. Both HTTP servers
wrap that wait here: the work is cancelled as soon as the client is gone (which aborts the
engine request on a worker and closes the upstream connection on the router), so a client
that leaves never keeps KV blocks, a queue slot or a worker busy.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")

POLL_S = 0.25  # how often a waiting request asks whether its client is still there


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T], poll_s: float = POLL_S) -> T:
    """Await `work`, cancelling it if the client leaves first (then raise `ClientGone`)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
