"""Admission through the router: its bounded queue, per-key rate limits, daily quotas, and the
hashed key file, against fake workers on real ports."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tandem.router.accounting.keys_store import KeyLimits, new_key, write_store
from tandem.router.config import AccountingConfig, AdmissionPolicy, Timeouts, WorkerSpec
from tests.support.router_helpers import FakeWorker

FakeFactory = Callable[[str], tuple[FakeWorker, str]]
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5}


def _chat(url: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers, timeout=30)


def test_a_full_queue_answers_429_and_a_long_wait_408(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    worker, worker_url = fake_workers("slow")
    worker.behaviour.mode = "hang"
    worker.behaviour.hang_s = 2.5
    url = start_router(
        [WorkerSpec(worker_url, "both")],
        admission=AdmissionPolicy(max_in_flight=1, max_queue=1, queue_timeout_s=1.0),
        timeouts=Timeouts(connect_s=1.0, first_byte_s=10.0, idle_s=10.0),
    )
    results: dict[str, httpx.Response] = {}

    def send(name: str) -> None:
        results[name] = _chat(url)

    first = threading.Thread(target=send, args=("first",))
    first.start()
    time.sleep(0.3)  # it holds the one slot
    queued = threading.Thread(target=send, args=("queued",))
    queued.start()
    time.sleep(0.3)  # it waits in the one queue place
    full = _chat(url)
    assert full.status_code == 429 and full.json()["error"]["code"] == "router_queue_full"
    assert full.json()["error"]["type"] == "rate_limit_error" and full.headers["retry-after"]
    queued.join()
    assert results["queued"].status_code == 408
    assert results["queued"].json()["error"]["code"] == "router_queue_timeout"
    first.join()
    assert results["first"].status_code == 200
    worker.behaviour.mode = "ok"
    assert _chat(url).status_code == 200  # the slot came back
    assert len(worker.requests) == 2  # the refused ones never reached a worker


@pytest.fixture
def key_file(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """alice: 2 requests a minute; bob: 20 tokens a minute; carol: 100 tokens a day; dave: none."""
    entries, keys = [], {}
    for name, limits in (
        ("alice", KeyLimits(rpm=2)),
        ("bob", KeyLimits(tpm=20)),
        ("carol", KeyLimits(tokens_per_day=100)),
        ("dave", KeyLimits()),
    ):
        key, entry = new_key(name, limits, {e.id for e in entries})
        entries.append(entry)
        keys[name] = key
    path = tmp_path / "keys.json"
    write_store(path, entries)
    return path, keys


def test_rate_limits_and_quotas_per_key(
    fake_workers: FakeFactory,
    start_router: Callable[..., str],
    key_file: tuple[Path, dict[str, str]],
    tmp_path: Path,
) -> None:
    _, worker_url = fake_workers("worker")
    path, keys = key_file
    url = start_router(
        [WorkerSpec(worker_url, "both")],
        accounting=AccountingConfig(api_keys_file=path, ledger_path=tmp_path / "usage.sqlite3"),
    )
    # alice: a burst of two, then the bucket is empty for about 30 s
    assert [_chat(url, keys["alice"]).status_code for _ in range(2)] == [200, 200]
    refused = _chat(url, keys["alice"])
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_requests"
    assert 20 <= int(refused.headers["retry-after"]) <= 31
    # bob: admitted while his token bucket is not in debt; each request costs ~60 tokens
    codes = [_chat(url, keys["bob"]) for _ in range(3)]
    assert [c.status_code for c in codes[:1]] == [200]
    assert codes[-1].status_code == 429
    assert codes[-1].json()["error"]["code"] == "rate_limit_tokens"
    # carol: 55 tokens a request (50 prompt + 5 completion, as the worker counts them)
    assert [_chat(url, keys["carol"]).status_code for _ in range(2)] == [200, 200]
    over = _chat(url, keys["carol"])
    assert over.status_code == 429 and over.json()["error"]["code"] == "quota_exceeded"
    assert "110 of 100 tokens per day" in over.json()["error"]["message"]
    # dave has no limits, and nobody's limit touched anyone else
    assert all(_chat(url, keys["dave"]).status_code == 200 for _ in range(5))


def test_the_key_file_holds_hashes_and_a_revoked_key_stops_working(
    fake_workers: FakeFactory,
    start_router: Callable[..., str],
    key_file: tuple[Path, dict[str, str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tandem.router.accounting.keys_store import read_store

    _, worker_url = fake_workers("worker")
    path, keys = key_file
    text = path.read_text()
    assert not any(key in text for key in keys.values())  # salted hashes only
    assert path.stat().st_mode & 0o777 == 0o600
    caplog.set_level(logging.DEBUG)
    url = start_router([WorkerSpec(worker_url, "both")],
                       accounting=AccountingConfig(api_keys_file=path))
    assert _chat(url, keys["dave"]).status_code == 200
    wrong = keys["dave"][:-1] + ("A" if keys["dave"][-1] != "A" else "B")
    assert _chat(url, wrong).status_code == 401  # right id, wrong secret
    assert _chat(url, "sk-tandem-00000000-" + "A" * 43).status_code == 401
    entries = read_store(path)
    write_store(path, [e if e.identity != "dave" else type(e)(**{**e.__dict__, "revoked": "now"})
                       for e in entries])
    deadline = time.monotonic() + 5
    while _chat(url, keys["dave"]).status_code != 401 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _chat(url, keys["dave"]).status_code == 401
    assert _chat(url, keys["alice"]).status_code == 200  # the others still work
    assert not any(key in caplog.text for key in keys.values())


def _raw(url: str, payload: bytes, pause_after: int | None = None, pause_s: float = 0.0) -> str:
    """POST over a bare socket (to send a body slowly or lie about its length); the status line."""
    import socket
    from urllib.parse import urlparse

    target = urlparse(url)
    with socket.create_connection((target.hostname, target.port), timeout=10) as sock:
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode()
        sock.sendall(head + payload[:pause_after])
        if pause_after is not None:
            time.sleep(pause_s)
            with contextlib.suppress(OSError):  # it may have answered and closed already
                sock.sendall(payload[pause_after:])
        return sock.recv(65536).decode(errors="replace")


def test_request_limits_refuse_big_slow_and_crowded_requests(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    from tandem.config import RequestLimits

    worker, worker_url = fake_workers("worker")
    url = start_router(
        [WorkerSpec(worker_url, "both")],
        limits=RequestLimits(max_body_bytes=4096, body_timeout_s=0.5, max_messages=3, max_tools=1),
    )
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    reply = httpx.post(f"{url}/v1/chat/completions", json=big, timeout=10)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit applies as the body arrives
        yield b'{"model": "fake", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    reply = httpx.post(f"{url}/v1/chat/completions", content=chunks(), timeout=10,
                       headers={"Content-Type": "application/json"})
    assert reply.status_code == 413
    payload = json.dumps(CHAT).encode()
    assert _raw(url, payload, pause_after=10, pause_s=1.0).startswith("HTTP/1.1 408")
    crowded = {**CHAT, "messages": [{"role": "user", "content": "hi"}] * 4}
    reply = httpx.post(f"{url}/v1/chat/completions", json=crowded, timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(2)]
    reply = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "tools": tools}, timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"
    assert worker.requests == []  # none of them reached the worker
    assert _chat(url).status_code == 200  # and the router serves on
