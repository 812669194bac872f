"""SIGTERM drains a worker: the stream it runs finishes, new requests get a retryable 503,
/health fails, and the process stops once nothing is left (not at the timeout)."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil

from tests.support.live_server import start_server
from tests.support.processes import wait_ended

STORY = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Tell me a long story."}],
         "max_tokens": 120, "ignore_eos": True, "temperature": 0, "stream": True,
         "stream_options": {"include_usage": True}}


def test_sigterm_drains_running_streams_and_refuses_new_requests(tmp_path: Path) -> None:
    server = start_server(tmp_path / "serve.log", "--kv-cache-memory", "64MiB", "--shutdown-timeout", "60")
    children = psutil.Process(server.process.pid).children(recursive=True)
    usage: dict = {}
    tokens = 0

    def stream() -> None:
        nonlocal tokens
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=STORY, timeout=120) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage.update(chunk["usage"])
                    elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        tokens += 1

    running = threading.Thread(target=stream)
    try:
        running.start()
        deadline = time.monotonic() + 60
        while tokens < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the next tick sees it
        refused = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                             json={**STORY, "stream": False, "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "draining"
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
        assert server.process.poll() is None  # the stream still runs
        running.join(120)
        assert usage["completion_tokens"] == 120  # finished, not cut
        started = time.monotonic()
        server.process.wait(30)
        assert time.monotonic() - started < 15  # stopped when drained, not at the 60 s timeout
    finally:
        if server.process.poll() is None:
            server.process.kill()
    log = server.log()
    assert "SIGTERM: draining; 1 request(s) in flight" in log
    assert "drained: nothing in flight; stopping" in log
    alive = wait_ended(children, timeout=10)
    assert not alive
