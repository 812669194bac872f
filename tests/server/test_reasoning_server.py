"""`tandem serve --reasoning-parser`: a response's reasoning comes back as `reasoning_content`,
whole or streamed, and the answer without it. SmolLM2 does not think, so the request opens
the block itself: a final assistant message `<think>…` continued (`continue_final_message`)
leaves the prompt inside the reasoning, as DeepSeek-R1's template does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.live_server import LiveServer, start_server, stop_server
from tests.support.pd_cluster import streamed_reasoning_and_content

ARGS = ("--kv-cache-memory", "256MiB", "--threads", "1", "--reasoning-parser", "deepseek_r1")
THINKING = {
    "messages": [{"role": "user", "content": "What is 2 + 2?"},
                 {"role": "assistant", "content": "<think>The user asks"}],
    "continue_final_message": True, "add_generation_prompt": False,
    "max_tokens": 8, "temperature": 0, "ignore_eos": True,
}
PLAIN = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(Path(tmp_path_factory.mktemp("reasoning")) / "serve.log", *ARGS)
    try:
        yield live
    finally:
        stop_server(live)


def _whole(server: LiveServer, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]


def _streamed(server: LiveServer, body: dict[str, Any]) -> tuple[str, str]:
    return streamed_reasoning_and_content(server.url, body)


def test_the_reasoning_comes_apart_whole_and_streamed(server: LiveServer) -> None:
    message = _whole(server, THINKING)
    assert message["reasoning_content"], message  # the model went on thinking
    assert "<think>" not in message["reasoning_content"]
    assert message["content"] == ""  # max_tokens cut it mid-thought: no answer yet
    assert _streamed(server, THINKING) == (message["reasoning_content"], message["content"])


def test_an_answer_without_reasoning_has_none(server: LiveServer) -> None:
    message = _whole(server, PLAIN)
    assert message["reasoning_content"] is None and message["content"]
    assert _streamed(server, PLAIN) == ("", message["content"])
