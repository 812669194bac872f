"""Admission by sequences and tokens, and aborts that always reach the engine.

What was seen before: one 22 KB `/v1/completions` with 2,000 prompts and `n` 8 queued 15,736
sequences past `--max-waiting` 512 (admission counted HTTP requests); when it failed, the
2,000 aborts sent were dropped (a non-blocking send into a full queue, only logged), and the
engine worked 3.5 minutes for nobody while other clients timed out.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.live_server import LiveServer, start_router, start_server, stop_server

MODEL = "smollm2-135m"
PROMPTS = [f"Item {i}: say one word." for i in range(2000)]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The defaults: --max-waiting 512 sequences."""
    server = start_server(tmp_path_factory.mktemp("admission") / "serve.log", "--kv-cache-memory", "64MiB")
    yield server
    assert not stop_server(server)


def _generated(server: LiveServer) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tandem:generation_tokens_total"))


def test_a_request_of_more_sequences_than_the_queue_takes_is_refused_before_anything_is_queued(
        guarded: LiveServer, tmp_path) -> None:  # noqa: ANN001
    body = {"model": MODEL, "prompt": PROMPTS, "n": 8, "max_tokens": 16, "temperature": 0.7}
    started = time.monotonic()
    reply = httpx.post(f"{guarded.url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "request_too_large" and "16000 sequences" in error["message"]
    load = guarded.load()
    assert load["num_waiting_requests"] == load["num_running_requests"] == 0
    assert time.monotonic() - started < 60  # refused, not worked on (generous: CI boxes are slow)
    # Through a router: the worker's 400 passes unchanged, and nothing is retried elsewhere.
    url, router = start_router(tmp_path / "router.log", "--worker", guarded.url, "--no-ledger")
    try:
        routed = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert routed.status_code == 400 and routed.json()["error"]["code"] == "request_too_large"
    finally:
        router.send_signal(signal.SIGINT)
        router.wait(30)
    # Prompt tokens count too: a request whose prompts alone exceed --max-waiting-tokens.
    huge = {"model": MODEL, "prompt": ["word " * 1000] * 100, "max_tokens": 1}  # over 64 contexts of 1,456
    reply = httpx.post(f"{guarded.url}/v1/completions", json=huge, timeout=120)
    assert reply.status_code == 400 and "prompt tokens" in reply.json()["error"]["message"]
    ok = httpx.post(f"{guarded.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert ok.status_code == 200
    assert guarded.wait_idle()["kv_blocks_used"] == 0


def test_every_abort_reaches_the_engine(tmp_path) -> None:  # noqa: ANN001
    """With no admission limit at all, 2,000 prompts are queued, and the client leaves after the
    first chunk: the engine must drop all of them, not work on for nobody."""
    server = start_server(tmp_path / "serve.log", "--kv-cache-memory", "64MiB", "--max-waiting", "0",
                          "--max-waiting-tokens", "0")
    try:
        before = _generated(server)
        body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break  # the client leaves
        deadline = time.monotonic() + 180
        load = server.load()
        while (load["num_waiting_requests"] or load["num_running_requests"]) and time.monotonic() < deadline:
            time.sleep(0.5)
            load = server.load()
        assert load["num_waiting_requests"] == load["num_running_requests"] == 0, load
        assert load["kv_blocks_used"] == 0
        # Had the aborts been dropped, up to 2,000 x 64 tokens would have been generated.
        assert _generated(server) - before < 2000 * 64 // 10
        assert "could not send" not in server.log()
    finally:
        assert not stop_server(server)
