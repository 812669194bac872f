"""Reasoning through a PD split: prefill and decode workers with --reasoning-parser behind
`tandem route`. The prefill worker's first token may be reasoning or answer; the decode worker
sends it itself, so a streamed response's reasoning equals the whole one's, first token
included (the router does not send a token it cannot place)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.pd_cluster import PdCluster, pd_cluster, streamed_reasoning_and_content
from tests.support.router_helpers import metric

# Blocks of 16 tokens: a short prompt still hands a block off.
ARGS = ("--kv-cache-memory", "256MiB", "--threads", "1", "--reasoning-parser", "deepseek_r1", "--block-size", "16")
# SmolLM2 does not think: the request leaves a think block open, as DeepSeek-R1's template does.
THINKING = {
    "messages": [{"role": "user", "content": "What is 2 + 2? Explain."},
                 {"role": "assistant", "content": "<think>The user asks"}],
    "continue_final_message": True, "add_generation_prompt": False,
    "max_tokens": 8, "temperature": 0, "ignore_eos": True,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdCluster]:
    with pd_cluster(tmp_path_factory.mktemp("router-reasoning"), *ARGS) as made:
        yield made


def test_a_streamed_reasoning_response_through_pd_loses_no_token(cluster: PdCluster) -> None:
    alone = cluster.decode.post("/v1/chat/completions", THINKING)  # one worker, whole
    assert alone.status_code == 200, alone.text
    expected = alone.json()["choices"][0]["message"]
    assert expected["reasoning_content"] and expected["content"] == ""
    assert streamed_reasoning_and_content(cluster.url, THINKING) == (expected["reasoning_content"], "")
    whole = httpx.post(f"{cluster.url}/v1/chat/completions", json=THINKING, timeout=300).json()
    assert whole["choices"][0]["message"]["reasoning_content"] == expected["reasoning_content"]
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert metric(text, "tandem_router_requests_total", route="pd", endpoint="chat", status="200") == 2
