"""A client that leaves aborts its request: the engine stops it and its KV blocks come back."""

from __future__ import annotations

import httpx
import pytest

from tests.support.live_server import LiveServer

LONG = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 3000, "ignore_eos": True, "temperature": 0}


def test_stream_disconnect_frees_blocks(tandem_server_process: LiveServer) -> None:
    url = tandem_server_process.url
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/chat/completions",
                                                          json={**LONG, "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        seen = [next(lines) for _ in range(6)]
        assert any('"content"' in line for line in seen)
        busy = tandem_server_process.load()
        assert busy["kv_blocks_used"] > 0 and busy["num_requests_in_flight"] == 1
    load = tandem_server_process.wait_idle()
    assert load["kv_blocks_used"] == 0 and load["num_requests_in_flight"] == 0


def test_whole_response_disconnect_frees_blocks(tandem_server_process: LiveServer) -> None:
    url = tandem_server_process.url
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", json=LONG, timeout=2.0)
    load = tandem_server_process.wait_idle()
    assert load["kv_blocks_used"] == 0 and load["num_requests_in_flight"] == 0


def test_completion_stream_disconnect_frees_blocks(tandem_server_process: LiveServer) -> None:
    url = tandem_server_process.url
    body = {"model": "smollm2-135m", "prompt": ["Once upon a time", "In a land far away"], "n": 2,
            "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(8):
            next(lines)
    load = tandem_server_process.wait_idle()
    assert load["kv_blocks_used"] == 0 and load["num_requests_in_flight"] == 0
