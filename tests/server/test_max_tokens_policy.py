"""--max-tokens-policy cap (the default): a max_tokens past what the context leaves is served,
capped there, and the response says so; a prompt that alone fills the context is a 400 naming
both numbers. Agent harnesses send max_tokens 32000 whatever the model (OpenCode does), and
vLLM's 400 stops them at the first turn. A real server with a 128-token context, directly and
through a real `tandem route`, which passes the notes on."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.support.live_server import LiveServer, start_router, start_server, stop_server

MODEL = "smollm2-135m"
CONTEXT = 128
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 32000,
       "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    logs = tmp_path_factory.mktemp("max-tokens")
    live = start_server(logs / "serve.log", "--max-model-len", str(CONTEXT), "--kv-cache-memory", "64MiB")
    yield live
    assert not stop_server(live)


@pytest.fixture(scope="module")
def router(server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url, process = start_router(tmp_path_factory.mktemp("max-tokens-router") / "route.log", "--worker", server.url)
    yield url
    process.terminate()
    process.wait(timeout=30)


def _prompt_tokens(url: str) -> int:
    reply = httpx.post(f"{url}/v1/chat/completions", json=ASK | {"max_tokens": 1}, timeout=60).json()
    return reply["usage"]["prompt_tokens"]


def _check_capped(headers: httpx.Headers, usage: dict, finish_reason: str, prompt_tokens: int) -> None:
    applied = CONTEXT - prompt_tokens
    assert headers["x-tandem-max-tokens-applied"] == str(applied)
    assert headers["x-tandem-max-tokens-requested"] == "32000"
    assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == applied
    assert finish_reason == "length"


@pytest.mark.parametrize("through_router", [False, True], ids=["direct", "router"])
def test_chat_max_tokens_past_the_context_is_capped(server: LiveServer, router: str, through_router: bool) -> None:
    url = router if through_router else server.url
    prompt_tokens = _prompt_tokens(url)
    reply = httpx.post(f"{url}/v1/chat/completions", json=ASK, timeout=120)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    _check_capped(reply.headers, body["usage"], body["choices"][0]["finish_reason"], prompt_tokens)
    assert server.wait_idle()["kv_blocks_used"] == 0


@pytest.mark.parametrize("through_router", [False, True], ids=["direct", "router"])
def test_streamed_chat_is_capped_too(server: LiveServer, router: str, through_router: bool) -> None:
    url = router if through_router else server.url
    prompt_tokens = _prompt_tokens(url)
    events, finish, usage = [], None, None
    body = ASK | {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        headers = reply.headers
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    for event in events:
        for choice in event.get("choices", []):
            finish = choice.get("finish_reason") or finish
        usage = event.get("usage") or usage
    assert usage is not None and finish is not None
    _check_capped(headers, usage, finish, prompt_tokens)


def test_completion_max_tokens_is_capped_and_an_uncapped_request_has_no_note(server: LiveServer) -> None:
    prompt = list(range(100, 150))
    reply = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 500,
                                                             "temperature": 0, "ignore_eos": True}, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-tandem-max-tokens-applied"] == str(CONTEXT - len(prompt))
    assert reply.json()["usage"]["completion_tokens"] == CONTEXT - len(prompt)
    plain = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3},
                       timeout=60)
    assert plain.status_code == 200 and "x-tandem-max-tokens-applied" not in plain.headers


@pytest.mark.parametrize("length", [CONTEXT, CONTEXT + 40])
def test_a_prompt_that_fills_the_context_is_a_400_naming_both_numbers(server: LiveServer, length: int) -> None:
    reply = httpx.post(f"{server.url}/v1/completions",
                       json={"model": MODEL, "prompt": [100 + i % 500 for i in range(length)], "max_tokens": 5},
                       timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"{CONTEXT} tokens" in error["message"] and f"the prompt has {length}" in error["message"]
    assert httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                      timeout=60).status_code == 200


def test_an_unknown_policy_is_refused_at_start() -> None:
    from tandem.config import ServerConfig

    with pytest.raises(ValueError, match="cap or reject"):
        ServerConfig(max_tokens_policy="truncate")
