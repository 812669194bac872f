"""Circuit breakers, the retry budget and busy workers, against fake workers on real ports."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from tandem.router.config import BreakerPolicy, PolicyConfig, RetryPolicy, WorkerSpec
from tests.support.live_server import TEST_SECRET
from tests.support.router_helpers import FakeWorker, metric

FakeFactory = Callable[[str], tuple[FakeWorker, str]]
ADMIN = {"Authorization": f"Bearer {TEST_SECRET}"}  # the router fixture's cluster secret opens its control plane
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5}
FULL = "Hello there, friend."
ROUND_ROBIN = PolicyConfig(name="round_robin")
# Cool-downs long enough that four fake replies fit inside one on a loaded box.
QUICK_BREAKER = BreakerPolicy(failures=3, window_s=30.0, cooldown_s=2.0, max_cooldown_s=8.0)


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
    time.sleep(2.1)  # the cool-down: one trial, which fails and doubles it
    for _ in range(4):
        assert _chat(url).status_code == 200
    assert len(bad.requests) == 4 and _worker(url, bad_url)["breaker"] == "open"
    bad.behaviour.mode = "ok"
    time.sleep(4.1)
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


def test_draining_a_worker_sends_it_nothing_new_until_it_resumes(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    a, a_url = fake_workers("a")
    b, b_url = fake_workers("b")
    url = start_router([WorkerSpec(a_url, "both"), WorkerSpec(b_url, "both")], policy=ROUND_ROBIN)
    worker_id = a_url.split("://")[1]
    # The control plane needs the admin key (here the cluster secret: no --admin-key given).
    assert httpx.post(f"{url}/workers/{worker_id}/drain", timeout=10).status_code == 401
    drained = httpx.post(f"{url}/workers/{worker_id}/drain", timeout=10, headers=ADMIN).json()
    assert drained["draining"] is True and drained["id"] == worker_id
    before = len(a.requests)
    for _ in range(4):
        assert _chat(url).status_code == 200
    assert len(a.requests) == before and len(b.requests) >= 4
    assert httpx.post(f"{url}/workers/{worker_id}/resume", timeout=10, headers=ADMIN).json()["draining"] is False
    for _ in range(4):
        assert _chat(url).status_code == 200
    assert len(a.requests) > before
    missing = httpx.post(f"{url}/workers/nowhere:1/drain", timeout=10, headers=ADMIN)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "worker_not_found"


def test_a_draining_worker_answers_503_and_the_router_moves_on(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    """What a worker says while it drains (503 draining with Retry-After) is "busy": the
    request goes to another worker and the breaker is not fed."""
    busy, busy_url = fake_workers("draining")
    _, good_url = fake_workers("good")
    busy.behaviour.mode = "draining"
    url = start_router(
        [WorkerSpec(busy_url, "both"), WorkerSpec(good_url, "both")],
        policy=ROUND_ROBIN,
        breaker=QUICK_BREAKER,
    )
    for _ in range(6):
        assert _chat(url).status_code == 200
    assert len(busy.requests) >= 3 and _worker(url, busy_url)["breaker"] == "closed"


def test_sigterm_drains_the_router(fake_workers: FakeFactory, tmp_path) -> None:  # noqa: ANN001
    """A `tandem route` process: after SIGTERM its running stream completes, new requests and
    /health get 503 'draining', and it exits once the stream is done."""
    import json
    import signal
    import subprocess
    import sys
    import threading

    from tandem.platform.ports import free_port

    worker, worker_url = fake_workers("slow")
    worker.behaviour.tokens = tuple(f" w{i}" for i in range(40))
    # 8 s of stream: the checks below must run while it is still going (at 10 ms a token it
    # could end, and the router exit, before a loaded box had sent the /health probe)
    worker.behaviour.token_gap_s = 0.2
    port = free_port()
    log = tmp_path / "router.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tandem", "route", "--port", str(port), "--worker", worker_url,
             "--no-ledger", "--shutdown-timeout", "30"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        pieces: list[str] = []

        def stream() -> None:
            body = {**CHAT, "max_tokens": 40, "stream": True}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        pieces.append((chunk["choices"] or [{}])[0].get("delta", {}).get("content") or "")

        running = threading.Thread(target=stream)
        running.start()
        while len(pieces) < 3:
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = _chat(url)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        running.join(60)
        assert "".join(pieces) == "".join(worker.behaviour.tokens)
        assert process.wait(15) is not None
    finally:
        if process.poll() is None:
            process.kill()
    assert "drained: nothing in flight; stopping" in log.read_text()


def test_two_routers_send_a_sessions_turns_to_the_same_worker(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    """Two router replicas behind one address share no state: the affinity ring over the same
    workers gives both the same answer for every session, whichever replica a turn hits."""
    workers = [fake_workers(f"w{i}") for i in range(3)]
    specs = [WorkerSpec(u, "both") for _, u in workers]
    routers = [start_router(specs), start_router(specs)]
    sessions = [f"session-{i}" for i in range(12)]
    for turn in range(4):
        for n, session in enumerate(sessions):
            url = routers[(n + turn) % 2]  # alternate replicas turn by turn
            body = {**CHAT, "messages": [{"role": "user", "content": session}]}
            reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30,
                               headers={"x-session-affinity": session})
            assert reply.status_code == 200
    homes = {}
    for index, (worker, _) in enumerate(workers):
        for request in worker.requests:
            homes.setdefault(request["messages"][0]["content"], set()).add(index)
    assert sorted(homes) == sorted(sessions)
    assert all(len(where) == 1 for where in homes.values()), homes  # one worker per session
    assert len({next(iter(w)) for w in homes.values()}) > 1  # and sessions spread out
