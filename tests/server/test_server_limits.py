"""API key, admission control, request limits and SIGTERM, on a server of its own started with
strict limits."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.live_server import LiveServer, start_server, stop_server

KEY = "sk-test-key"
LONG = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 2000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("strict") / "serve.log"
    server = start_server(log, "--kv-cache-memory", "128MiB", "--max-num-seqs", "1", "--max-waiting", "1",
                          "--api-key", KEY, "--max-request-bytes", "64KiB", "--max-messages", "8",
                          "--max-tools", "2", "--body-timeout", "1", token=KEY)
    yield server
    left = stop_server(server, signal.SIGTERM)
    assert not left, f"processes left after SIGTERM: {left}"
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the parent sees why it ended.
    assert server.process.returncode in (0, -signal.SIGTERM), server.log()[-3000:]
    assert "Application shutdown complete" in server.log()
    assert "engine core stops" in server.log()


def test_api_key_is_required_on_v1(strict_server: LiveServer) -> None:
    url = strict_server.url
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.json()["error"]["type"] == "authentication_error"  # as the router's 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert good.chat.completions.create(**body).usage.completion_tokens >= 1
    assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
    # With a key on, the views and the control plane need it too (the only key, so it is the admin's).
    for method, path in (("GET", "/load"), ("GET", "/metrics"), ("GET", "/kv/events"), ("POST", "/reset_prefix_cache")):
        assert httpx.request(method, f"{url}{path}").status_code == 401, path
        assert httpx.request(method, f"{url}{path}", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_queue_beyond_max_waiting_gets_429(strict_server: LiveServer) -> None:
    url = strict_server.url
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=60, headers=headers) as client, \
            client.stream("POST", f"{url}/v1/chat/completions", json=LONG) as running:
        running_lines = running.iter_lines()  # held: dropping it would close the connection
        next(line for line in running_lines if '"content":"' in line and '"role"' not in line)
        with client.stream("POST", f"{url}/v1/chat/completions", json=LONG) as queued:
            assert queued.status_code == 200
            deadline = time.monotonic() + 10
            while strict_server.load()["num_waiting_requests"] < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            refused = client.post(f"{url}/v1/chat/completions", json={**LONG, "stream": False})
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "overloaded"
    strict_server.wait_idle()
    # Admission counts sequences, not requests: n=2 can never fit a queue of one.
    too_many = httpx.post(f"{url}/v1/completions", headers=headers, timeout=60,
                          json={"model": "smollm2-135m", "prompt": "Hi", "n": 2, "max_tokens": 2})
    assert too_many.status_code == 400 and too_many.json()["error"]["code"] == "request_too_large"
    assert "2 sequences" in too_many.json()["error"]["message"]
    reply = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=60,
                       json={**LONG, "stream": False, "max_tokens": 3})
    assert reply.status_code == 200
    assert strict_server.wait_idle()["kv_blocks_used"] == 0


def test_request_limits_refuse_before_the_engine_sees_anything(strict_server: LiveServer) -> None:
    url = strict_server.url
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    huge = {**body, "messages": [{"role": "user", "content": "word " * 20000}]}
    reply = httpx.post(f"{url}/v1/chat/completions", json=huge, headers=headers, timeout=30)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    crowded = {**body, "messages": [{"role": "user", "content": "Hi"}] * 9}
    reply = httpx.post(f"{url}/v1/chat/completions", json=crowded, headers=headers, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    reply = httpx.post(f"{url}/v1/chat/completions", json={**body, "tools": [tool] * 3}, headers=headers,
                       timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"
    # A client that sends half its body and stalls gets a 408 after --body-timeout.
    import socket
    from urllib.parse import urlparse

    target = urlparse(url)
    payload = json.dumps(body).encode()
    with socket.create_connection((target.hostname, target.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                     + payload[:10])
        started = time.monotonic()
        answer = sock.recv(65536).decode(errors="replace")
    assert answer.startswith("HTTP/1.1 408") and 0.8 < time.monotonic() - started < 5
    assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60).status_code == 200
    assert strict_server.wait_idle()["kv_blocks_used"] == 0
