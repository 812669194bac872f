"""Reasoning through a PD split: prefill and decode workers with --reasoning-parser behind
`tandem route`. The prefill worker's first token may be reasoning or answer; the decode worker
sends it itself, so a streamed response's reasoning equals the whole one's, first token
included (the router does not send a token it cannot place)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tandem.router.config import HealthPolicy, RouterConfig, WorkerSpec
from tandem.router.http.app import build_app
from tests.support.live_server import TEST_SECRET, LiveServer, start_server, stop_server
from tests.support.router_helpers import MODEL_TIMEOUTS, ThreadServer, metric

ARGS = ("--kv-cache-memory", "256MiB", "--threads", "1", "--reasoning-parser", "deepseek_r1")
# SmolLM2 does not think: the request leaves a think block open, as DeepSeek-R1's template does.
THINKING = {
    "messages": [{"role": "user", "content": "What is 2 + 2? Explain."},
                 {"role": "assistant", "content": "<think>The user asks"}],
    "continue_final_message": True, "add_generation_prompt": False,
    "max_tokens": 8, "temperature": 0, "ignore_eos": True,
}


@dataclass
class Cluster:
    prefill: LiveServer
    decode: LiveServer
    url: str


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("router-reasoning")
    started: list[LiveServer] = []
    router: ThreadServer | None = None
    try:
        started.append(start_server(logs / "prefill.log", "--role", "prefill", *ARGS, secret=TEST_SECRET))
        started.append(start_server(logs / "decode.log", "--role", "decode", *ARGS, secret=TEST_SECRET))
        prefill, decode = started
        config = RouterConfig(
            workers=(WorkerSpec(prefill.url, "prefill"), WorkerSpec(decode.url, "decode")),
            health=HealthPolicy(interval_s=0.5, timeout_s=5.0), timeouts=MODEL_TIMEOUTS,
            pd_min_prompt_tokens=0, cluster_secret=TEST_SECRET)
        router = ThreadServer(build_app(config)).start(timeout=60)
        yield Cluster(prefill, decode, router.url)
    finally:
        if router is not None:
            router.stop()
        for server in started:
            assert not stop_server(server)


def _streamed(url: str, body: dict[str, Any]) -> tuple[str, str]:
    reasoning, content = [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=300) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    reasoning.append(choice["delta"].get("reasoning_content", ""))
                    content.append(choice["delta"].get("content", ""))
    return "".join(reasoning), "".join(content)


def test_a_streamed_reasoning_response_through_pd_loses_no_token(cluster: Cluster) -> None:
    alone = cluster.decode.post("/v1/chat/completions", THINKING)  # one worker, whole
    assert alone.status_code == 200, alone.text
    expected = alone.json()["choices"][0]["message"]
    assert expected["reasoning_content"] and expected["content"] == ""
    assert _streamed(cluster.url, THINKING) == (expected["reasoning_content"], "")
    whole = httpx.post(f"{cluster.url}/v1/chat/completions", json=THINKING, timeout=300).json()
    assert whole["choices"][0]["message"]["reasoning_content"] == expected["reasoning_content"]
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert metric(text, "tandem_router_requests_total", route="pd", endpoint="chat", status="200") == 2
