"""`/v1/messages` and `/v1/messages/count_tokens` through `tandem route`, with the `anthropic`
SDK, unmodified: direct (in front of the session's `tandem serve`, with API keys, which Claude
Code sends as `x-api-key`) and prefill/decode (1 prefill + 1 decode `tandem serve` with the
cluster secret, every request split). Greedy output is the same on both paths, whole or
streamed; usage is exact (its three input counts add up to the worker's `/tokenize` count) and
says what the cache did.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tandem.router.config import AccountingConfig, WorkerSpec
from tests.support import claude_code
from tests.support.anthropic_events import accumulate, split_sse
from tests.support.live_server import LiveServer
from tests.support.pd_cluster import PdCluster, pd_cluster
from tests.support.router_helpers import MODEL_TIMEOUTS, metric

MODEL = "smollm2-135m"
BLOCK = 16  # the workers' --block-size, as the session's server's (tests/conftest.py)
WORKER_ARGS = ("--kv-cache-memory", "256MiB", "--threads", "1", "--max-num-seqs", "16", "--block-size", str(BLOCK))
# The SDK has no temperature (newer Claude models take none); Claude Code sends one, and so do these.
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}
KEY = "sk-claude-code"
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


class Pd(PdCluster):
    def requests(self, route: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return metric(text, "tandem_router_requests_total", route=route, endpoint="messages", status="200")


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pd]:
    with pd_cluster(tmp_path_factory.mktemp("router-messages"), *WORKER_ARGS) as made:
        yield Pd(made.prefill, made.decode, made.url)


@pytest.fixture
def direct(tandem_server: str, start_router: Callable[..., str], tmp_path: Path) -> str:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{KEY} claude\n")
    return start_router([WorkerSpec(tandem_server, "both")], accounting=AccountingConfig(api_keys_file=keys),
                        timeouts=MODEL_TIMEOUTS)


def _client(url: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=180)


def _nonce() -> str:
    return f"Ticket {uuid.uuid4().hex}."


def _content(message: Any) -> list[dict[str, Any]]:
    """The content blocks as dicts, without what only the stream helper adds (parsed_output)."""
    return [{k: v for k, v in b.model_dump().items() if k not in ("parsed_output", "citations")}
            for b in message.content]


def _input_total(usage: Any) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def _tokenize(worker: LiveServer | str, messages: list[dict[str, Any]]) -> int:
    body = {"messages": messages}
    reply = worker.post("/tokenize", body) if isinstance(worker, LiveServer) else httpx.post(
        f"{worker}/tokenize", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["count"]


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_both_paths_whole_and_streamed(pd: Pd, direct: str, tandem_server: str) -> None:
    user = f"{_nonce()} Name three colours, briefly."
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 20, **GREEDY, "system": "Be brief.",
                              "messages": [{"role": "user", "content": user}]}
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": user}]
    before = pd.requests("pd")
    replies = {}
    for name, url, worker in (("direct", direct, tandem_server), ("pd", pd.url, pd.prefill)):
        client = _client(url)
        whole = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
        assert _content(streamed) == _content(whole) and streamed.stop_reason == whole.stop_reason, name
        assert streamed.usage.output_tokens == whole.usage.output_tokens, name
        count = _tokenize(worker, prompt)
        assert _input_total(whole.usage) == _input_total(streamed.usage) == count, name
        assert streamed.usage.cache_read_input_tokens > 0, name  # the second time: from the cache
        replies[name] = whole
    assert _text(replies["direct"]) == _text(replies["pd"]) and _text(replies["pd"])
    assert replies["direct"].stop_reason == replies["pd"].stop_reason
    assert pd.requests("pd") == before + 2  # both were split: prefill hop, KV handoff, decode hop


def test_a_tool_round_trip_split(pd: Pd) -> None:
    client = _client(pd.url)
    question = {"role": "user", "content": "Find the weather for Tokyo, please."}
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 60, **GREEDY, "tools": [WEATHER],
                              "tool_choice": {"type": "tool", "name": "get_weather"}, "messages": [question]}
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    whole = client.messages.create(**kwargs)
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    calls = [b for b in streamed.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and isinstance(calls[0].input, dict)
    assert [(b.type, getattr(b, "input", None)) for b in whole.content] == [
        (b.type, getattr(b, "input", None)) for b in streamed.content]
    history = [question, {"role": "assistant", "content": streamed.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                             "content": "21 C and clear"}]}]
    answer = client.messages.create(model=MODEL, max_tokens=16, tools=[WEATHER],
                                    messages=history, **GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=history)
    assert counted.input_tokens == _input_total(answer.usage)


def test_a_cache_breakpoint_split(pd: Pd) -> None:
    system = [{"type": "text", "text": f"{_nonce()} You answer questions about geography in one short "
                                      "sentence, politely and precisely.",
               "cache_control": {"type": "ephemeral"}}]
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 4, **GREEDY, "system": system,
                              "messages": [{"role": "user", "content": "Capital of Peru?"}]}
    client = _client(pd.url)
    first = client.messages.create(**kwargs).usage
    with client.messages.stream(**kwargs) as stream:
        second = stream.get_final_message().usage
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens > BLOCK
    assert second.cache_read_input_tokens >= first.cache_creation_input_tokens - BLOCK
    assert second.cache_creation_input_tokens < BLOCK
    assert _input_total(first) == _input_total(second)


def test_a_claude_code_turn_split(pd: Pd) -> None:
    """Claude Code's request, raw, through the split path: Anthropic's stream, the session
    from its header, count_tokens equal to the usage, the billing header out of the prompt."""
    messages = [{"role": "user", "content": f"{_nonce()} Say hi."}]
    counts = []
    for nonce in ("5f1c2", "9e3d0"):
        body = claude_code.body(messages, model=MODEL, max_tokens=8, temperature=0,
                                system=claude_code.system(header=claude_code.billing_header(nonce=nonce)))
        with httpx.Client(base_url=pd.url, headers=claude_code.headers(), timeout=180) as http:
            streamed = http.post("/v1/messages?beta=true", json=body)
            assert streamed.status_code == 200, streamed.text
            message = accumulate(split_sse(streamed.text))
            counted = http.post("/v1/messages/count_tokens?beta=true", json={
                k: body[k] for k in ("model", "messages", "system", "tools")})
        assert counted.status_code == 200, counted.text
        usage = message["usage"]
        total = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
        assert counted.json() == {"input_tokens": total}
        assert message["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
        counts.append(total)
    assert counts[0] == counts[1]
    assert usage["cache_read_input_tokens"] >= total - BLOCK  # the other billing header: a cache hit


def test_keys_and_errors_in_anthropic_shape(direct: str, pd: Pd) -> None:
    hi = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(anthropic.AuthenticationError):
        _client(direct, "sk-wrong").messages.create(**hi)
    with pytest.raises(anthropic.AuthenticationError):
        _client(direct, "sk-wrong").messages.count_tokens(model=MODEL, messages=hi["messages"])
    assert httpx.post(f"{direct}/v1/messages", json=hi, timeout=60).status_code == 401  # no key at all
    assert _client(direct).messages.create(**hi).content  # x-api-key, as the SDK sends it
    bearer = httpx.post(f"{direct}/v1/messages", json=hi, headers={"authorization": f"Bearer {KEY}"}, timeout=120)
    assert bearer.status_code == 200, bearer.text
    assert _client(direct).messages.count_tokens(model=MODEL, messages=hi["messages"]).input_tokens > 0
    for url in (direct, pd.url):
        client = _client(url)
        with pytest.raises(anthropic.BadRequestError) as bad:
            client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
        assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.NotFoundError) as missing:  # the worker's refusal, reshaped
            client.messages.create(**{**hi, "model": "not-served-here"})
        assert missing.value.body["error"]["type"] == "not_found_error"
        with pytest.raises(anthropic.NotFoundError) as missing:
            client.messages.count_tokens(model="not-served-here", messages=hi["messages"])
        assert missing.value.body["error"]["type"] == "not_found_error"
        assert client.messages.create(**hi).content  # and it goes on serving
