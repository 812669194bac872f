"""Non-streamed chat requests for `tandem bench tools`, N in flight, and the server's counters.

The serve bench's load client streams, which is what its latency figures need; this bench
needs each whole response (the tool calls, the usage) and a wall time, so it posts plain
requests with the same httpx settings and the same helpers: the model list of
`load_client.list_models` and its reading of an error body. A failed request is recorded with
its error, never raised: an unsupported feature (a 400 for `strict` or `response_format`) is
a figure of the run, not the end of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from tandem.bench.load_client import _error_message, list_models
from tandem.bench.tools_workloads import parse_counters

CHAT_PATH = "/v1/chat/completions"


@dataclass
class Reply:
    """One request's outcome: the decoded body, or the error that came instead."""

    index: int
    body: dict[str, Any] | None = None
    status: int | None = None
    error: str | None = None
    latency_s: float = 0.0

    @property
    def completion_tokens(self) -> int:
        usage = (self.body or {}).get("usage")
        value = usage.get("completion_tokens") if isinstance(usage, dict) else None
        return value if isinstance(value, int) else 0

    @property
    def finish_reason(self) -> str | None:
        choices = (self.body or {}).get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        return first.get("finish_reason") if isinstance(first, dict) else None


@dataclass
class Batch:
    """The replies of one batch of requests, in request order, and the batch's wall time."""

    replies: list[Reply]
    duration_s: float

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.replies if r.error is not None]

    @property
    def output_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.replies if r.error is None)

    @property
    def output_tok_s(self) -> float | None:
        ok = [r for r in self.replies if r.error is None]
        return self.output_tokens / self.duration_s if ok and self.duration_s > 0 else None


def _client(base_url: str, api_key: str | None, concurrency: int, timeout_s: float,
            transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, limits=limits,
                             timeout=httpx.Timeout(timeout_s, connect=30.0), transport=transport)


async def _post(client: httpx.AsyncClient, index: int, body: dict[str, Any]) -> Reply:
    reply = Reply(index)
    start = time.perf_counter()
    try:
        response = await client.post(CHAT_PATH, json=body)
        reply.status = response.status_code
        if response.status_code != 200:
            reply.error = _error_message(response.status_code, response.content)
        else:
            decoded = response.json()
            if isinstance(decoded, dict):
                reply.body = decoded
            else:
                reply.error = f"not a JSON object: {response.text[:200]!r}"
    except httpx.HTTPError as exc:
        reply.error = f"{type(exc).__name__}: {exc}"[:500]
    except ValueError as exc:  # a 200 whose body is not JSON
        reply.error = f"bad JSON body: {exc}"[:500]
    reply.latency_s = time.perf_counter() - start
    return reply


async def post_all_async(base_url: str, bodies: Sequence[dict[str, Any]], concurrency: int,
                         api_key: str | None = None, timeout_s: float = 600.0,
                         on_reply: Callable[[Reply], None] | None = None,
                         transport: httpx.AsyncBaseTransport | None = None) -> Batch:
    """Post every body to /v1/chat/completions, `concurrency` at a time (a closed loop);
    `transport` replaces the network (tests)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    replies: list[Reply | None] = [None] * len(bodies)
    queue = list(range(len(bodies)))[::-1]
    async with _client(base_url, api_key, concurrency, timeout_s, transport) as client:
        start = time.perf_counter()

        async def worker() -> None:
            while queue:
                index = queue.pop()
                reply = await _post(client, index, bodies[index])
                replies[index] = reply
                if on_reply is not None:
                    on_reply(reply)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)) or 1)))
        duration = time.perf_counter() - start
    return Batch([r for r in replies if r is not None], duration)


def post_all(base_url: str, bodies: Sequence[dict[str, Any]], concurrency: int, **kwargs: Any) -> Batch:
    """`post_all_async` in a fresh event loop."""
    return asyncio.run(post_all_async(base_url, bodies, concurrency, **kwargs))


def served_model(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The first model of GET /v1/models (ValueError when there is none or it fails)."""

    async def first() -> str:
        async with _client(base_url, api_key, 1, timeout_s) as client:
            models = await list_models(client)
        if not models:
            raise ValueError(f"{base_url}: GET /v1/models lists no model; give --served-model-name")
        return models[0]

    try:
        return asyncio.run(first())
    except httpx.HTTPError as exc:
        raise ValueError(f"{base_url}: GET /v1/models failed ({exc}); give --served-model-name") from exc


def read_counters(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> dict[str, float] | None:
    """GET /metrics as sample name -> value (None: the server has no readable /metrics)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return parse_counters(response.text)
    except ValueError:
        return None
