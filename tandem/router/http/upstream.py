"""HTTP to workers: one hop with its timeouts, retries before the first byte, SSE reading.

A hop is "open" once the worker's response headers arrived. Everything that can go wrong
before that (connection refused or reset, a 5xx, a 429, no headers within the first-byte
limit) is retried on another worker of the same pool after a jittered backoff, within the
retry budget, because the client has seen nothing yet. Any other 4xx is the client's fault and
comes back as it is. After the headers, each
read waits at most the idle limit.

httpx's own read timeout is off: it would apply to the wait for headers as well, and a
non-streamed reply sends its headers only when generation ends, so the first-byte and idle
limits are enforced here with `asyncio.timeout` around each await.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

from tandem.router.config import RetryPolicy, Timeouts
from tandem.router.resilience.retry_budget import RetryBudget
from tandem.router.workers.registry import DispatchKind, WorkerEndpoint
from tandem.trust.peer import PeerAuth

logger = logging.getLogger(__name__)


class HopFailure(Exception):
    """A worker failed before sending a usable response (or mid-stream, for `StreamBroken`)."""

    def __init__(
        self,
        worker: WorkerEndpoint,
        reason: str,
        status: int | None = None,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        timed_out: bool = False,
    ) -> None:
        super().__init__(f"{worker.url}: {reason}")
        self.worker = worker
        self.reason = reason
        self.status = status
        self.body = body
        self.headers = headers or {}
        self.timed_out = timed_out

    @property
    def transport(self) -> bool:
        """No HTTP answer at all (the worker may be dead), as opposed to a 5xx status."""
        return self.status is None

    @property
    def busy(self) -> bool:
        """"Full, try another worker" (429, or a 503 with Retry-After: a full queue or a
        drain), not a fault: it moves the request on without feeding the breaker."""
        if self.status == 429:
            return True
        return self.status == 503 and any(k.lower() == "retry-after" for k in self.headers)


class StreamBroken(Exception):
    """The worker's stream stopped without `[DONE]`: dropped, reset or idle too long."""


def make_client(timeouts: Timeouts, secret: str | None = None) -> httpx.AsyncClient:
    """One shared client. No connection cap (the default 100 would queue requests behind
    each other), keep-alive shorter than uvicorn's 5 s so a reused connection is never one
    the worker is closing, and no proxies from the environment: workers are local. With the
    cluster secret, every request it sends is signed (tandem/trust/peer.py): hops, health and
    load polls, KV events, tokenize hops and lease releases alike."""
    return httpx.AsyncClient(
        auth=PeerAuth(secret) if secret else None,
        timeout=httpx.Timeout(
            connect=timeouts.connect_s, read=None, write=timeouts.idle_s, pool=None
        ),
        limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=256, keepalive_expiry=4.0
        ),
        trust_env=False,
    )


@dataclass
class Hop:
    """One open request to one worker; the worker's accounting lasts as long as the hop."""

    worker: WorkerEndpoint
    response: httpx.Response
    started: float
    handle: int
    attempts: int
    headers_at: float = field(default_factory=time.monotonic)
    _closed: bool = False

    @property
    def status(self) -> int:
        return self.response.status_code

    async def close(self) -> None:
        """Idempotent; shielded so that a cancelled request still closes its upstream stream,
        which is how the worker learns to abort."""
        if self._closed:
            return
        self._closed = True
        self.worker.in_flight -= 1
        self.worker.settle(self.handle)
        with anyio.CancelScope(shield=True):
            await self.response.aclose()


class Upstream:
    def __init__(
        self,
        client: httpx.AsyncClient,
        timeouts: Timeouts,
        retry: RetryPolicy,
        on_failure: Callable[[str, HopFailure], None],
        on_retry: Callable[[str], None],
        on_retry_denied: Callable[[str], None] = lambda hop: None,
    ) -> None:
        self.client = client
        self.timeouts = timeouts
        self.retry = retry
        self.budget = RetryBudget(retry)
        self._random = random.Random()
        self._on_failure = on_failure
        self._on_retry = on_retry
        self._on_retry_denied = on_retry_denied

    def report(self, hop_name: str, failure: HopFailure) -> None:
        """A failure seen outside `open` (a stream that broke): the worker's health counts it."""
        self._on_failure(hop_name, failure)

    async def open(
        self,
        worker: WorkerEndpoint,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        kind: DispatchKind,
        tokens: int,
    ) -> Hop:
        """POST and wait for the headers; 5xx and transport errors raise HopFailure."""
        started = time.monotonic()
        worker.in_flight += 1
        handle = worker.dispatch(kind, tokens, started)
        response: httpx.Response | None = None
        try:
            request = self.client.build_request(
                "POST", worker.url + path, json=body, headers=headers
            )
            watch = LostWatch(worker, self.timeouts.down_silence_s)
            try:
                async with watch.timeout(self.timeouts.first_byte_s):
                    response = await self.client.send(request, stream=True)
            except TimeoutError as exc:
                reason = (
                    _DOWN if watch.lost else f"no response within {self.timeouts.first_byte_s:g} s"
                )
                raise HopFailure(worker, reason, timed_out=True) from exc
            except httpx.TransportError as exc:
                raise HopFailure(worker, f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
            finally:
                watch.close()
            if response.status_code >= 500 or response.status_code == 429:
                data = b""
                with contextlib.suppress(httpx.HTTPError, TimeoutError):
                    data = await self.read(response)
                raise HopFailure(
                    worker,
                    f"HTTP {response.status_code}",
                    response.status_code,
                    data,
                    _passed_headers(response),
                )
            worker.breaker.record_success()
            return Hop(worker, response, started, handle, 1)
        except BaseException:
            worker.in_flight -= 1
            worker.settle(handle)
            if response is not None:
                with anyio.CancelScope(shield=True):
                    await response.aclose()
            raise

    async def open_with_retries(
        self,
        hop_name: str,
        pick: Callable[[set[str]], WorkerEndpoint | None],
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        kind: DispatchKind,
        tokens: int | Callable[[WorkerEndpoint], int],
    ) -> Hop:
        """Try workers from `pick` (which skips the URLs it is given) until one answers.

        `tokens` is the load the hop adds to a worker until its polled load shows it (a
        number, or a function of the worker when that depends on what it has cached).

        Raises the last HopFailure when every attempt failed, or LookupError when `pick` had
        no worker to offer at all.
        """
        tried: set[str] = set()
        dead: set[str] = set()
        last: HopFailure | None = None
        delay = self.retry.backoff_s
        self.budget.on_request(time.monotonic())
        for attempt in range(self.retry.max_attempts):
            if attempt and not self.budget.try_retry(time.monotonic()):
                self._on_retry_denied(hop_name)
                logger.warning(
                    "%s hop not retried: the retry budget is spent (%.0f%% of requests)",
                    hop_name,
                    self.retry.budget_ratio * 100,
                )
                break
            worker = pick(tried) or pick(dead)  # a worker that answered 5xx may be tried again
            if worker is None:
                break
            if attempt:
                self._on_retry(hop_name)
                # Full jitter: retries after one failure spread out instead of arriving at once.
                await asyncio.sleep(self._random.uniform(0, delay) if self.retry.jitter else delay)
                delay *= self.retry.backoff_multiplier
            try:
                load = tokens(worker) if callable(tokens) else tokens
                hop = await self.open(worker, path, body, headers, kind, load)
            except HopFailure as failure:
                last = failure
                tried.add(worker.url)
                if failure.transport:
                    dead.add(worker.url)
                self._on_failure(hop_name, failure)
                logger.warning(
                    "%s hop to %s failed (attempt %d/%d): %s",
                    hop_name,
                    worker.url,
                    attempt + 1,
                    self.retry.max_attempts,
                    failure.reason,
                )
                continue
            hop.attempts = attempt + 1
            return hop
        if last is None:
            raise LookupError(hop_name)
        raise last

    async def read(self, response: httpx.Response) -> bytes:
        async with asyncio.timeout(self.timeouts.idle_s):
            return await response.aread()

    async def events(
        self,
        response: httpx.Response,
        is_output: Callable[[str], bool] | None = None,
        worker: WorkerEndpoint | None = None,
    ) -> AsyncIterator[str]:
        """The `data:` payloads of an SSE stream, through `[DONE]`; StreamBroken otherwise.

        A worker answers with headers (and a chat stream's role chunk) at once and its first
        output when the request's first token is out, after however long the request waited
        in its queue: that wait is bounded by `first_byte_s`, like the wait for the headers;
        the gaps after it by `idle_s` (a worker that stops mid-stream). `is_output` tells an
        output event from a preamble (default: every event is output). With `worker`, the
        stream also breaks as soon as the health checks mark that worker down: a cut link
        leaves the stream silent rather than closed."""
        lines = response.aiter_lines()
        data: list[str] = []
        timeout = self.timeouts.first_byte_s
        watch = LostWatch(worker, self.timeouts.down_silence_s) if worker is not None else None
        try:
            while True:
                try:
                    async with watch.timeout(timeout) if watch else asyncio.timeout(timeout):
                        line = await anext(lines)
                except StopAsyncIteration:
                    raise StreamBroken("the worker closed the stream before [DONE]") from None
                except TimeoutError:
                    if watch is not None and watch.lost:
                        raise StreamBroken(_DOWN) from None
                    raise StreamBroken(f"no data for {timeout:g} s") from None
                except httpx.HTTPError as exc:
                    raise StreamBroken(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
                if line.startswith("data:"):
                    data.append(line[5:].lstrip(" "))
                    continue
                if line or not data:
                    continue  # comments, other fields, keep-alive blank lines
                payload = "\n".join(data)
                data = []
                if timeout != self.timeouts.idle_s and (is_output is None or is_output(payload)):
                    timeout = self.timeouts.idle_s
                yield payload
                if payload == "[DONE]":
                    return
        finally:
            if watch is not None:
                watch.close()
            await lines.aclose()


_DOWN = "the worker went down (its health checks fail) while the router waited on it"


class LostWatch:
    """The timeouts of one wait on a worker, cut short when the worker goes down.

    A worker behind a cut link or a frozen host sends nothing at all, not a reset, so a
    stream on it would wait out its idle timeout (minutes when prefills are long). The health
    monitor notices within a few polls and calls `WorkerEndpoint.lost`; a wait that has been silent
    for `silence_s` by then ends at once, a younger one once it has (and every later wait on
    the worker is bounded by `silence_s`). A stream still flowing is left alone: an
    overloaded worker whose /health answered late is slow, not gone. `lost` tells such an
    expiry from a plain timeout."""

    def __init__(self, worker: WorkerEndpoint, silence_s: float) -> None:
        self.lost = False
        self.silence_s = silence_s
        self._current: asyncio.Timeout | None = None
        self._since = 0.0
        self._unwatch = worker.watch_lost(self._expire)

    def timeout(self, seconds: float) -> asyncio.Timeout:
        self._since = asyncio.get_running_loop().time()
        self._current = asyncio.timeout(min(seconds, self.silence_s) if self.lost else seconds)
        return self._current

    def _expire(self) -> None:
        self.lost = True
        current = self._current
        if current is None or current.expired():
            return
        when = max(self._since + self.silence_s, asyncio.get_running_loop().time())
        deadline = current.when()
        if deadline is None or when < deadline:
            with contextlib.suppress(RuntimeError):  # not entered, or already left
                current.reschedule(when)

    def close(self) -> None:
        self._unwatch()


def _passed_headers(response: httpx.Response) -> dict[str, str]:
    """Worker headers worth passing on with an error (Retry-After on a full worker)."""
    return {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
