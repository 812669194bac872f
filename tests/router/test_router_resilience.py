"""Circuit breakers, the retry budget and busy workers, against fake workers on real ports."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
from router_helpers import FakeWorker, metric

from tandem.router.config import BreakerPolicy, PolicyConfig, RetryPolicy, WorkerSpec

FakeFactory = Callable[[str], tuple[FakeWorker, str]]
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5}
FULL = "Hello there, friend."
ROUND_ROBIN = PolicyConfig(name="round_robin")
QUICK_BREAKER = BreakerPolicy(failures=3, window_s=10.0, cooldown_s=1.0, max_cooldown_s=4.0)


def _chat(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)


def _worker(url: str, worker_url: str) -> dict:
    workers = httpx.get(f"{url}/workers", timeout=10).json()["workers"]
    return next(w for w in workers if w["url"] == worker_url)


def test_a_failing_worker_is_cut_off_by_its_breaker_then_tried_again(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    """It answers /health but every request with a 500: three failures open its breaker, no
    request reaches it for the cool-down, then one trial does; once fixed, it closes."""
    bad, bad_url = fake_workers("bad")
    _, good_url = fake_workers("good")
    bad.behaviour.mode = "error500"
    url = start_router(
        [WorkerSpec(bad_url, "both"), WorkerSpec(good_url, "both")],
        policy=ROUND_ROBIN,
        breaker=QUICK_BREAKER,
    )
    for _ in range(8):
        reply = _chat(url)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == FULL
    assert len(bad.requests) == 3
    state = _worker(url, bad_url)
    assert state["breaker"] == "open" and state["breaker_trips"] == 1 and state["healthy"]
    metrics = httpx.get(f"{url}/metrics").text
    assert metric(metrics, "tandem_router_worker_breaker_state", worker=bad_url) == 1
    assert metric(metrics, "tandem_router_worker_breaker_trips_total", worker=bad_url) == 1
    time.sleep(1.1)  # the cool-down: one trial, which fails and doubles it
    for _ in range(4):
        assert _chat(url).status_code == 200
    assert len(bad.requests) == 4 and _worker(url, bad_url)["breaker"] == "open"
    bad.behaviour.mode = "ok"
    time.sleep(2.1)
    for _ in range(4):
        assert _chat(url).status_code == 200
    assert _worker(url, bad_url)["breaker"] == "closed" and len(bad.requests) >= 6


def test_a_decode_leg_failure_never_feeds_the_prefill_workers_breaker(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    prefill, prefill_url = fake_workers("prefill")
    broken, broken_url = fake_workers("decode")
    _, spare_url = fake_workers("decode")
    broken.behaviour.mode = "error500"
    url = start_router(
        [
            WorkerSpec(prefill_url, "prefill"),
            WorkerSpec(broken_url, "decode"),
            WorkerSpec(spare_url, "decode"),
        ],
        policy=ROUND_ROBIN,
        breaker=QUICK_BREAKER,
    )
    for _ in range(8):
        assert _chat(url).json()["choices"][0]["message"]["content"] == FULL
    assert _worker(url, broken_url)["breaker"] == "open"
    assert _worker(url, prefill_url)["breaker"] == "closed"
    assert len(prefill.requests) == 8  # every request was still split


def test_a_busy_worker_moves_the_request_on_without_tripping_its_breaker(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    busy, busy_url = fake_workers("busy")
    _, good_url = fake_workers("good")
    busy.behaviour.mode = "busy429"
    url = start_router(
        [WorkerSpec(busy_url, "both"), WorkerSpec(good_url, "both")],
        policy=ROUND_ROBIN,
        breaker=QUICK_BREAKER,
    )
    for _ in range(6):
        assert _chat(url).status_code == 200
    assert len(busy.requests) >= 3 and _worker(url, busy_url)["breaker"] == "closed"
    alone = start_router([WorkerSpec(busy_url, "both")])
    reply = _chat(alone)
    assert reply.status_code == 429 and reply.headers["retry-after"] == "2"
    assert reply.json()["error"]["code"] == "overloaded"


def test_the_retry_budget_caps_retries(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    """With no budget at all, a 500 goes to the client even though another worker is fine."""
    bad, bad_url = fake_workers("bad")
    _, good_url = fake_workers("good")
    bad.behaviour.mode = "error500"
    url = start_router(
        [WorkerSpec(bad_url, "both"), WorkerSpec(good_url, "both")],
        policy=ROUND_ROBIN,
        retry=RetryPolicy(max_attempts=3, backoff_s=0.01, budget_ratio=0.0, budget_min_per_s=0.0),
    )
    codes = [_chat(url).status_code for _ in range(4)]
    assert codes.count(500) == len(bad.requests) >= 1 and codes.count(200) >= 1
    metrics = httpx.get(f"{url}/metrics").text
    assert metric(metrics, "tandem_router_retries_denied_total") == codes.count(500)
    assert metric(metrics, "tandem_router_retries_total") == 0
