"""`/v1/messages` and `/v1/messages/count_tokens` on a live `tandem serve` (the session's, on
the default model), through the official `anthropic` SDK, unmodified, and raw HTTP where the
SDK would not send what is tested (a missing max_tokens, Claude Code's own headers).

Everything is greedy, so a stream and a whole reply of the same request must say the same;
every prompt opens with a nonce so that its cache counts are its own.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import anthropic
import httpx
import pytest

from tests.support import claude_code
from tests.support.anthropic_events import accumulate, split_sse

MODEL = "smollm2-135m"
BLOCK = 16
# The SDK has no temperature (newer Claude models take none); Claude Code sends one, and so do these.
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def client(tandem_server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tandem_server, api_key="unused", max_retries=0, timeout=120)


def _nonce() -> str:
    return f"Ticket {uuid.uuid4().hex}."


def _content(message: Any) -> list[dict[str, Any]]:
    """The content blocks as dicts, without what only the stream helper adds (parsed_output)."""
    return [{k: v for k, v in b.model_dump().items() if k not in ("parsed_output", "citations")}
            for b in message.content]


def _input_total(usage: Any) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def _tokenize(url: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
    body: dict[str, Any] = {"messages": messages}
    if tools:
        body["tools"] = tools
    reply = httpx.post(f"{url}/tokenize", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["count"]


def test_a_message_whole_and_streamed(client: anthropic.Anthropic, tandem_server: str) -> None:
    user = f"{_nonce()} Name three colours."
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 24, **GREEDY, "system": "Be brief.",
                              "messages": [{"role": "user", "content": user}]}
    whole = client.messages.create(**kwargs)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.model == MODEL and [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    assert (whole.stop_reason == "max_tokens") == (whole.usage.output_tokens == 24)
    # The three input counts add up to the prompt's exact length.
    assert _input_total(whole.usage) == _tokenize(tandem_server, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": user}])
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert _content(streamed) == _content(whole) and streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert _input_total(streamed.usage) == _input_total(whole.usage)
    assert streamed.usage.cache_read_input_tokens > 0  # the same prompt again: read from the cache


def test_a_stop_sequence_is_named(client: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 40, **GREEDY,
                              "messages": [{"role": "user", "content": f"{_nonce()} Count from 1 to 20."}]}
    # The ticket's random digits steer greedy text run to run (a reply may be the ticket alone,
    # one "word"), so the stop is four characters from the middle of whatever it writes.
    text = client.messages.create(**kwargs).content[0].text
    assert len(text) >= 8, text
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    whole = client.messages.create(**kwargs, stop_sequences=["never-written", stop])
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", stop)
    with client.messages.stream(**kwargs, stop_sequences=["never-written", stop]) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    assert _content(streamed) == _content(whole) and stop not in whole.content[0].text


def test_a_tool_round_trip(client: anthropic.Anthropic, tandem_server: str) -> None:
    question = {"role": "user", "content": "Find the weather for Tokyo, please."}
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 60, **GREEDY, "tools": [WEATHER],
                              "tool_choice": {"type": "tool", "name": "get_weather"}, "messages": [question]}
    reply = client.messages.create(**kwargs)
    assert reply.stop_reason == "tool_use"
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and isinstance(calls[0].input, dict)
    with client.messages.stream(**kwargs) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert "input_json_delta" in deltas
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in streamed.content] == [
        (b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in reply.content]
    history = [question, {"role": "assistant", "content": reply.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                             "content": "21 C and clear"}]}]
    answer = client.messages.create(model=MODEL, max_tokens=24, tools=[WEATHER],
                                    messages=history, **GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The call and its result reached the prompt: the count is the chat form's, exactly.
    chat_history = [
        question,
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].id, "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(calls[0].input, ensure_ascii=False)}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "21 C and clear"},
    ]
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    assert _input_total(answer.usage) == _tokenize(tandem_server, chat_history, tools)
    counted = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=history)
    assert counted.input_tokens == _input_total(answer.usage)


def test_count_tokens_is_the_prompt_a_request_runs(client: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": f"{_nonce()} Hello there."}]
    system = [{"type": "text", "text": "You are terse."}]
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=messages)
    reply = client.messages.create(model=MODEL, max_tokens=4, system=system, messages=messages)
    assert counted.input_tokens == _input_total(reply.usage) > 0


def test_a_claude_code_turn(tandem_server: str) -> None:
    """Claude Code's headers, betas, fields and tools, raw: the stream is in Anthropic's exact
    order and says what the whole reply says; the prompt is what count_tokens counts."""
    messages = [{"role": "user", "content": [{"type": "text", "text": f"{_nonce()} Say hi.",
                                              "cache_control": {"type": "ephemeral"}}]}]
    body = claude_code.body(messages, model=MODEL, max_tokens=12, temperature=0)
    with httpx.Client(base_url=tandem_server, headers=claude_code.headers(), timeout=120) as http:
        streamed = http.post("/v1/messages?beta=true", json=body)
        assert streamed.status_code == 200, streamed.text
        assert streamed.headers["content-type"].startswith("text/event-stream")
        message = accumulate(split_sse(streamed.text))
        whole = http.post("/v1/messages?beta=true", json={**body, "stream": False})
        assert whole.status_code == 200, whole.text
        counted = http.post("/v1/messages/count_tokens?beta=true", json={
            k: body[k] for k in ("model", "messages", "system", "tools", "thinking")})
    reply = whole.json()
    for key in ("type", "role", "model", "content", "stop_reason", "stop_sequence"):
        assert message[key] == reply[key], key
    assert message["usage"]["output_tokens"] == reply["usage"]["output_tokens"]
    assert message["id"].startswith("msg_") and message["id"] != reply["id"]
    for usage in (message["usage"], reply["usage"]):
        total = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
        assert counted.json() == {"input_tokens": total}
    assert message["usage"]["cache_creation_input_tokens"] > 0  # the breakpoint on the last message
    assert reply["usage"]["cache_read_input_tokens"] > 0


def test_the_billing_header_is_not_part_of_the_prompt(tandem_server: str) -> None:
    """Two turns that differ only in the billing header: one prompt, so the second reads the
    first's from the cache (Claude Code changes the header between versions and requests)."""
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    instructions = f"{_nonce()} You are Claude Code, an agent."
    counts, usages = [], []
    for version, nonce in (("2.1.3.a41", "5f1c2"), ("2.1.9.b07", "9e3d0")):
        body = claude_code.body(messages, model=MODEL, max_tokens=4, temperature=0, stream=False,
                                system=claude_code.system(instructions, claude_code.billing_header(version, nonce)))
        reply = httpx.post(f"{tandem_server}/v1/messages", json=body, headers=claude_code.headers(), timeout=120)
        assert reply.status_code == 200, reply.text
        usages.append(reply.json()["usage"])
        counted = httpx.post(f"{tandem_server}/v1/messages/count_tokens", json={
            k: body[k] for k in ("model", "messages", "system", "tools")}, timeout=60)
        counts.append(counted.json()["input_tokens"])
    assert counts[0] == counts[1]
    assert usages[0]["cache_read_input_tokens"] < BLOCK  # new instructions: at most the template's opening
    assert usages[1]["cache_read_input_tokens"] >= counts[1] - BLOCK  # all of it but the last block


def test_a_cache_breakpoint_is_written_once(client: anthropic.Anthropic) -> None:
    system = [{"type": "text", "text": f"{_nonce()} You answer questions about geography in one short "
                                      "sentence, politely and precisely.",
               "cache_control": {"type": "ephemeral"}}]
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 4, **GREEDY, "system": system,
                              "messages": [{"role": "user", "content": "Capital of Peru?"}]}
    first = client.messages.create(**kwargs).usage
    second = client.messages.create(**kwargs).usage
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens > BLOCK
    assert second.cache_read_input_tokens >= first.cache_creation_input_tokens - BLOCK
    assert second.cache_creation_input_tokens < BLOCK  # at most the part of a block not cached
    assert _input_total(first) == _input_total(second)


def test_server_tools_are_dropped_and_said_so(tandem_server: str) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
            "tools": [WEATHER, {"type": "web_search_20250305", "name": "web_search"}]}
    reply = httpx.post(f"{tandem_server}/v1/messages", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-tandem-ignored"] == "tool web_search_20250305"


def _error(reply: httpx.Response, status: int, kind: str) -> str:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


def test_errors_in_anthropic_shape(client: anthropic.Anthropic, tandem_server: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert bad.value.body["type"] == "error" and "text only" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="not-served-here", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    url = f"{tandem_server}/v1/messages"
    assert "max_tokens" in _error(httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
                                  400, "invalid_request_error")
    _error(httpx.post(url, content=b"{not json"), 400, "invalid_request_error")
    _error(httpx.post(url, json={"model": MODEL, "max_tokens": 10**6, "messages": [{"role": "user", "content": "x"}]}),
           400, "invalid_request_error")  # past the context (this server rejects rather than caps)
    _error(httpx.post(f"{url}/count_tokens", json={"model": MODEL, "messages": "x"}), 400, "invalid_request_error")
    _error(httpx.post(f"{url}/count_tokens", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
           404, "not_found_error")
    # Refusals made before a Messages route runs are in Anthropic's shape too.
    _error(httpx.post(f"{url}/nothing-here", json={}), 404, "not_found_error")
    _error(httpx.get(url), 405, "invalid_request_error")
    # ... and the server goes on serving.
    assert client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]).content
