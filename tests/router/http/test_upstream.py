"""HTTP to workers without processes (httpx mock transports): retries before the first byte,
and reading SSE.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tandem.router.config import RetryPolicy, Timeouts
from tandem.router.http.upstream import HopFailure, StreamBroken, Upstream
from tandem.router.workers.registry import WorkerEndpoint
from tests.support.router_helpers import healthy_worker


# --- retries before the first byte -------------------------------------------------------
def _upstream(handler, retry: RetryPolicy | None = None) -> tuple[Upstream, list[str]]:  # noqa: ANN001
    failures: list[str] = []
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    upstream = Upstream(
        client,
        Timeouts(connect_s=1, first_byte_s=0.5, idle_s=0.5),
        retry or RetryPolicy(max_attempts=3, backoff_s=0.001),
        lambda hop, failure: failures.append(f"{failure.worker.url}:{failure.status}"),
        lambda hop: None,
    )
    return upstream, failures


def _picker(workers: list[WorkerEndpoint]):  # noqa: ANN202
    def pick(exclude: set[str]) -> WorkerEndpoint | None:
        return next((w for w in workers if w.url not in exclude), None)

    return pick


def test_retry_moves_to_another_worker_before_the_first_byte() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            raise httpx.ConnectError("refused", request=request)
        if request.url.host == "b":
            return httpx.Response(503, json={"error": {"message": "full"}})
        return httpx.Response(200, json={"ok": True})

    workers = [healthy_worker("http://a"), healthy_worker("http://b"), healthy_worker("http://c")]
    upstream, failures = _upstream(handler)

    async def run() -> tuple[str, int, bytes]:
        hop = await upstream.open_with_retries(
            "direct", _picker(workers), "/v1/chat/completions", {}, {}, "prefill", 10
        )
        data = await upstream.read(hop.response)
        await hop.close()
        return hop.worker.url, hop.attempts, data

    url, attempts, data = asyncio.run(run())
    assert url == "http://c" and attempts == 3 and json.loads(data) == {"ok": True}
    assert failures == ["http://a:None", "http://b:503"]
    assert all(w.in_flight == 0 and w.unreflected_tokens() == 0 for w in workers)


def test_the_load_a_hop_adds_can_depend_on_the_worker() -> None:
    """kv_aware counts a just-sent request by the tokens that worker must compute (its cached
    prefix excluded), so each retry dispatches that worker's own figure."""
    workers = [healthy_worker("http://a"), healthy_worker("http://b")]
    predicted = {"http://a": 300, "http://b": 2500}
    seen: dict[str, int] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        url = f"http://{request.url.host}"
        seen[url] = next(w for w in workers if w.url == url).unreflected_tokens("prefill")
        if url == "http://a":
            return httpx.Response(503, json={"error": {"message": "full"}})
        return httpx.Response(200, json={"ok": True})

    upstream, _ = _upstream(handler)

    async def run() -> None:
        hop = await upstream.open_with_retries(
            "direct", _picker(workers), "/x", {}, {}, "prefill", lambda w: predicted[w.url]
        )
        await hop.close()

    asyncio.run(run())
    assert seen == predicted


def test_client_errors_are_not_retried() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.host)
        return httpx.Response(400, json={"error": {"message": "bad"}})

    upstream, _ = _upstream(handler)

    async def run() -> int:
        hop = await upstream.open_with_retries(
            "direct",
            _picker([healthy_worker("http://a"), healthy_worker("http://b")]),
            "/v1/completions",
            {},
            {},
            "prefill",
            1,
        )
        await hop.close()
        return hop.status

    assert asyncio.run(run()) == 400 and calls == ["a"]


def test_all_attempts_failing_raises_the_last_failure() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"error": {"message": "boom"}})

    upstream, failures = _upstream(handler, RetryPolicy(max_attempts=2, backoff_s=0.001))
    only = healthy_worker("http://a")

    async def run() -> None:
        await upstream.open_with_retries("direct", _picker([only]), "/x", {}, {}, "prefill", 1)

    with pytest.raises(HopFailure) as info:
        asyncio.run(run())
    # One worker that answered 5xx may be tried again: it was alive.
    assert info.value.status == 500 and failures == ["http://a:500", "http://a:500"]
    assert only.in_flight == 0


def test_no_worker_at_all_is_a_lookup_error() -> None:
    upstream, _ = _upstream(lambda request: httpx.Response(200))
    with pytest.raises(LookupError):
        asyncio.run(
            upstream.open_with_retries("decode", lambda exclude: None, "/x", {}, {}, "decode", 1)
        )


def test_sse_events_and_broken_streams() -> None:
    good = b'data: {"a":1}\n\n: keep-alive\n\ndata: [DONE]\n\n'
    cut = b'data: {"a":1}\n\n'

    async def events(payload: bytes) -> list[str]:
        upstream, _ = _upstream(lambda request: httpx.Response(200, content=payload))
        response = await upstream.client.send(
            upstream.client.build_request("GET", "http://a/"), stream=True
        )
        return [e async for e in upstream.events(response)]

    assert asyncio.run(events(good)) == ['{"a":1}', "[DONE]"]
    with pytest.raises(StreamBroken, match="before \\[DONE\\]"):
        asyncio.run(events(cut))


def test_the_first_event_may_wait_in_a_queue_up_to_the_first_byte_timeout() -> None:
    """A worker sends headers at once and its first event when the request's first token is out;
    a long queue must not read as a stalled stream. Gaps after the first event are bounded by
    the idle timeout."""

    def stream(first_after: float, gap: float):  # noqa: ANN202
        async def body():  # noqa: ANN202
            yield b'data: {"role":"assistant"}\n\n'  # a chat stream's preamble, sent at once
            await asyncio.sleep(first_after)
            yield b'data: {"a":1}\n\n'
            await asyncio.sleep(gap)
            yield b"data: [DONE]\n\n"

        return body()

    async def events(first_after: float, gap: float) -> list[str]:
        client = httpx.AsyncClient(transport=httpx.MockTransport(
            lambda request: httpx.Response(200, content=stream(first_after, gap))))
        upstream = Upstream(client, Timeouts(connect_s=1, first_byte_s=1.0, idle_s=0.2), RetryPolicy(),
                            lambda hop, failure: None, lambda hop: None)
        response = await client.send(client.build_request("GET", "http://a/"), stream=True)
        return [e async for e in upstream.events(response, is_output=lambda data: "role" not in data)]

    assert asyncio.run(events(first_after=0.5, gap=0.0)) == ['{"role":"assistant"}', '{"a":1}', "[DONE]"]
    with pytest.raises(StreamBroken, match="no data for 1 s"):
        asyncio.run(events(first_after=1.5, gap=0.0))
    with pytest.raises(StreamBroken, match="no data for 0.2 s"):
        asyncio.run(events(first_after=0.0, gap=0.5))


def test_a_worker_marked_down_ends_the_waits_on_it_at_once() -> None:
    """A cut link sends no reset: a stream on it, or a request waiting for its headers, hears
    nothing until its timeout. When the health checks mark the worker down (`WorkerEndpoint.lost`),
    both give up at once, long before their timeouts, and say why."""

    async def silence() -> None:  # the worker behind a cut link
        await asyncio.sleep(3600)

    def stream():  # noqa: ANN202
        async def body():  # noqa: ANN202
            yield b'data: {"a":1}\n\n'
            await silence()
            yield b"data: [DONE]\n\n"

        return body()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "headers-never-come":
            await silence()
        return httpx.Response(200, content=stream())

    worker = healthy_worker("http://a")
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    upstream = Upstream(client, Timeouts(connect_s=1, first_byte_s=60, idle_s=60, down_silence_s=0.5),
                        RetryPolicy(), lambda hop, failure: None, lambda hop: None)

    async def read_stream() -> tuple[list[str], float]:
        response = await client.send(client.build_request("GET", "http://a/"), stream=True)
        seen: list[str] = []
        asyncio.get_running_loop().call_later(0.3, worker.lost)
        started = time.monotonic()
        with pytest.raises(StreamBroken, match="went down"):
            async for event in upstream.events(response, worker=worker):
                seen.append(event)
        return seen, time.monotonic() - started

    seen, waited = asyncio.run(read_stream())
    assert seen == ['{"a":1}'] and 0.45 < waited < 5  # silent for down_silence_s, not 60 s

    async def open_hop() -> float:
        stuck = healthy_worker("http://headers-never-come")
        asyncio.get_running_loop().call_later(0.3, stuck.lost)
        started = time.monotonic()
        with pytest.raises(HopFailure, match="went down") as failure:
            await upstream.open(stuck, "/v1/chat/completions", {}, {}, "decode", 10)
        assert failure.value.timed_out and stuck.in_flight == 0
        return time.monotonic() - started

    assert asyncio.run(open_hop()) < 5
    # Nothing stays registered on the workers once the waits are over.
    assert not worker._on_lost


def test_a_stream_still_flowing_from_a_worker_marked_down_goes_on() -> None:
    """/health answering late (an overloaded worker) marks it down, but its streams that
    still deliver are not broken: only silence longer than down_silence_s ends a wait."""

    def stream():  # noqa: ANN202
        async def body():  # noqa: ANN202
            for i in range(12):
                yield b'data: {"i":%d}\n\n' % i
                await asyncio.sleep(0.1)
            yield b"data: [DONE]\n\n"

        return body()

    worker = healthy_worker("http://a")
    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(200, content=stream())))
    upstream = Upstream(client, Timeouts(connect_s=1, first_byte_s=60, idle_s=60, down_silence_s=0.5),
                        RetryPolicy(), lambda hop, failure: None, lambda hop: None)

    async def read() -> list[str]:
        response = await client.send(client.build_request("GET", "http://a/"), stream=True)
        asyncio.get_running_loop().call_later(0.25, worker.lost)
        return [event async for event in upstream.events(response, worker=worker)]

    events = asyncio.run(read())
    assert len(events) == 13 and events[-1] == "[DONE]"
