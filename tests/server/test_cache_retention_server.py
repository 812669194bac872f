"""A `cache_control` breakpoint keeps its prefix cached through a flood, on a live `tandem serve`.

A server with a small KV cache (about 50 blocks of 16 tokens) serves a system prompt marked
with a breakpoint and one of the same size without; a flood of unrelated prompts several times
the pool then goes through. The marked prefix still hits (`prompt_tokens_details.cached_tokens`)
while the unmarked one is recomputed, through the official openai client.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.live_server import LiveServer, start_server, stop_server

MODEL = "smollm2-135m"
BLOCK = 16
# About 0.7 MiB per block for this model in float32: ~50 blocks, ~800 tokens.
KV_MEMORY = "36MiB"
SYSTEM_WORDS = 40  # a system prompt of ~170 tokens: 10 or so blocks


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(tmp_path_factory.mktemp("retain") / "serve.log", "--kv-cache-memory", KV_MEMORY,
                        "--max-num-seqs", "4", "--block-size", str(BLOCK))
    yield live
    left = stop_server(live)
    assert not left, f"processes left after SIGINT: {left}"


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def system_text(seed: str) -> str:
    """A long system prompt whose first block is unique to `seed`."""
    words = " ".join(f"rule{n}" for n in range(SYSTEM_WORDS))
    return f"Ticket {seed}. You are a careful assistant. Follow these rules: {words}."


def ask(client: openai.OpenAI, system: str | list[dict[str, Any]], question: str) -> dict[str, Any]:
    reply = client.chat.completions.create(
        model=MODEL, max_tokens=1, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
    assert reply.usage is not None
    return reply.usage.model_dump()


def marked(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]


def test_a_marked_prefix_survives_a_flood_an_unmarked_one_does_not(client: openai.OpenAI,
                                                                   server: LiveServer) -> None:
    total_blocks = server.load()["kv_blocks_total"]
    kept_text, plain_text = system_text(uuid.uuid4().hex), system_text(uuid.uuid4().hex)

    first = ask(client, marked(kept_text), "What is the first rule?")
    breakpoint_tokens = first["prompt_tokens_details"]["cache_write_tokens"]
    assert breakpoint_tokens >= 8 * BLOCK and first["prompt_tokens_details"]["cached_tokens"] == 0
    plain = ask(client, [{"type": "text", "text": plain_text}], "What is the first rule?")
    assert abs(plain["prompt_tokens"] - first["prompt_tokens"]) < BLOCK  # about the same size
    load = server.wait_idle()
    assert load["kv_blocks_retained"] == breakpoint_tokens // BLOCK
    assert load["tiers"]["device"]["blocks_retained"] == breakpoint_tokens // BLOCK
    metrics = httpx.get(f"{server.url}/metrics").text
    assert f'tandem:kv_blocks_retained{{model_name="{MODEL}"}} {float(breakpoint_tokens // BLOCK)}' in metrics

    # Unrelated prompts, one at a time, three times the pool's worth.
    flooded = 0
    while flooded < 3 * total_blocks * BLOCK:
        usage = ask(client, system_text(uuid.uuid4().hex), "Say hello.")
        flooded += usage["prompt_tokens"]
    assert server.wait_idle()["kv_blocks_retained"] == breakpoint_tokens // BLOCK

    again = ask(client, marked(kept_text), "What is the last rule?")
    assert again["prompt_tokens_details"]["cached_tokens"] >= breakpoint_tokens // BLOCK * BLOCK
    assert again["prompt_tokens_details"]["cache_write_tokens"] < BLOCK
    plain_again = ask(client, [{"type": "text", "text": plain_text}], "What is the last rule?")
    assert plain_again["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("control", [{"type": "ephemeral", "ttl": "2h"}, {"type": "ephemeral", "ttl": -1},
                                     {"type": "forever"}, "yes"])
def test_a_breakpoint_outside_the_protocol_is_a_400(server: LiveServer, control: Any) -> None:
    body = {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief.", "cache_control": control}]},
        {"role": "user", "content": "Hi"}]}
    reply = server.post("/v1/chat/completions", body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert server.post("/v1/chat/completions", {**body, "messages": body["messages"][1:]}).status_code == 200
