"""The Messages adapter (tandem/edge/protocols/anthropic_*.py) without a server: requests to
chat, chat replies and chunk streams back, errors, and the stream accumulating to the reply
of the same output at every split point."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

from tandem.edge.errors import APIError, error_body
from tandem.edge.openai_protocol import ChatCompletionRequest
from tandem.edge.protocols.anthropic_messages import MessagesAdapter, MessagesTranslated
from tandem.edge.protocols.anthropic_reply import ThinkSplitter, usage
from tests.support import claude_code
from tests.support.anthropic_events import accumulate, parse_events

USER = [{"role": "user", "content": "Hi"}]


def to_chat(body: dict[str, Any], headers: dict[str, str] | None = None,
            adapter: MessagesAdapter | None = None) -> MessagesTranslated:
    translated = asyncio.run((adapter or MessagesAdapter()).to_chat(body, headers or {}))
    ChatCompletionRequest.model_validate(translated.chat)  # the chat path takes what it makes
    return translated


def refusal(body: Any, count: bool = False) -> dict[str, Any]:
    """The Anthropic error body of a refused request (it must be refused, with a 400)."""
    adapter = MessagesAdapter()
    with pytest.raises(APIError) as caught:
        asyncio.run(adapter.count_chat(body, {}) if count else adapter.to_chat(body, {}))
    assert caught.value.status == 400, caught.value.message
    shaped = adapter.error_body(400, caught.value.body())
    assert shaped["type"] == "error" and shaped["error"]["type"] == "invalid_request_error"
    return shaped


def minimal(**changes: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 64, "messages": USER, **changes}


# --- requests ----------------------------------------------------------------------------
def test_every_block_type_translates() -> None:
    body = minimal(system="Be brief.", messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather in Tokyo?",
                                      "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call the tool.", "signature": "c2ln"},
            {"type": "redacted_thinking", "data": "b3BhcXVl"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Tokyo"}},
            {"type": "tool_use", "id": "toolu_02", "name": "get_time", "input": {}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "21 C"},
            {"type": "tool_result", "tool_use_id": "toolu_02", "is_error": True,
             "content": [{"type": "text", "text": "no clock"}, {"type": "text", "text": "sorry"}]},
            {"type": "text", "text": "Thanks"},
        ]},
        {"role": "user", "content": "And Paris?"},
    ])
    chat = to_chat(body).chat
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Tokyo?",
                                      "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [
            {"id": "toolu_01", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}},
            {"id": "toolu_02", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ], "reasoning_content": "I should call the tool."},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "21 C"},
        {"role": "tool", "tool_call_id": "toolu_02", "content": "Error:\nno clock\nsorry"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
        {"role": "user", "content": "And Paris?"},  # consecutive user messages are fine
    ]
    assert "continue_final_message" not in chat


def test_text_before_a_tool_result_stays_before_it_and_breakpoints_stay_on_their_part() -> None:
    chat = to_chat(minimal(messages=[
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": [1, "é"]},
             "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "first"},
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "ok"}],
             "cache_control": {"type": "ephemeral"}},
        ]},
    ])).chat
    assert chat["messages"] == [
        {"role": "assistant", "content": [{"type": "text", "text": "", "cache_control": {"type": "ephemeral"}}],
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1, "é"]}'}}]},
        {"role": "user", "content": [{"type": "text", "text": "first"}]},
        {"role": "tool", "tool_call_id": "t1",
         "content": [{"type": "text", "text": "ok", "cache_control": {"type": "ephemeral"}}]},
    ]


def test_a_top_level_cache_control_marks_the_last_block() -> None:
    mark = {"type": "ephemeral"}
    chat = to_chat(minimal(cache_control=mark)).chat
    assert chat["messages"] == [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": mark}]}]
    chat = to_chat(minimal(cache_control=mark, messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "tool_result", "tool_use_id": "t", "content": "b"}]}])).chat
    assert chat["messages"][-1] == {"role": "tool", "tool_call_id": "t", "content": [
        {"type": "text", "text": "b", "cache_control": mark}]}


def test_a_final_assistant_message_is_continued() -> None:
    chat = to_chat(minimal(messages=[*USER, {"role": "assistant", "content": "The answer is"}])).chat
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False


def test_system_blocks_keep_breakpoints_and_drop_the_billing_header() -> None:
    chat = to_chat(minimal(system=[
        claude_code.billing_header(),
        {"type": "text", "text": "You are Claude Code."},
        {"type": "text", "text": "Be careful.", "cache_control": {"type": "ephemeral"}},
    ])).chat
    assert chat["messages"][0] == {"role": "system", "content": [
        {"type": "text", "text": "You are Claude Code."},
        {"type": "text", "text": "Be careful.", "cache_control": {"type": "ephemeral"}},
    ]}
    only_header = to_chat(minimal(system=[claude_code.billing_header()])).chat
    assert only_header["messages"] == USER  # nothing left of the system: no system message


def test_requests_differing_only_in_the_billing_header_are_the_same_chat_request() -> None:
    one = claude_code.body(USER, system=claude_code.system(header=claude_code.billing_header("2.1.3", "aaaa")))
    two = claude_code.body(USER, system=claude_code.system(header=claude_code.billing_header("2.1.9", "bbbb")))
    assert one != two
    assert to_chat(one).chat == to_chat(two).chat


def test_a_claude_code_request_is_accepted(caplog: pytest.LogCaptureFixture) -> None:
    adapter = MessagesAdapter()
    body = claude_code.body([{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>context</system-reminder>"},
        {"type": "text", "text": "Fix the bug in add.", "cache_control": {"type": "ephemeral"}}]}])
    with caplog.at_level(logging.INFO, logger="tandem.edge.protocols.anthropic_messages"):
        translated = to_chat(body, claude_code.headers(), adapter)
        to_chat(body, claude_code.headers(), adapter)
    chat = translated.chat
    assert translated.session == claude_code.SESSION and translated.thinking and translated.dropped == []
    assert [t["function"]["name"] for t in chat["tools"]] == [t["name"] for t in claude_code.TOOLS]
    assert chat["tools"][1]["function"]["parameters"] == claude_code.TOOLS[1]["input_schema"]
    assert chat["tool_choice"] == "auto" and chat["max_tokens"] == 32000 and chat["temperature"] == 1
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat["messages"][0]["content"] == [claude_code.system()[1]]  # the header is gone
    # Fields and betas it has no use for are logged, once per adapter, never refused.
    logged = [r.getMessage() for r in caplog.records]
    for name in ("field 'context_management'", "beta 'claude-code-20250219'", "beta 'effort-2025-11-24'"):
        assert sum(name in line for line in logged) == 1, (name, logged)
    # `output_config` is read (its `format`, structured outputs); Claude Code's has only an effort.
    assert "response_format" not in chat
    assert not any("'model'" in line or "'thinking'" in line for line in logged)


def test_tools_and_tool_choice() -> None:
    tools = [{"name": "f", "description": "does f", "input_schema": {"type": "object"}},
             {"type": "custom", "name": "g", "input_schema": {"type": "object", "properties": {}}},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
             {"type": "bash_20250124", "name": "bash"}]
    translated = to_chat(minimal(tools=tools))
    assert [t["function"] for t in translated.chat["tools"]] == [
        {"name": "f", "description": "does f", "parameters": {"type": "object"}},
        {"name": "g", "parameters": {"type": "object", "properties": {}}}]
    assert translated.dropped == ["tool web_search_20250305", "tool bash_20250124"]
    for choice, expected in [({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
                             ({"type": "none"}, "none"),
                             ({"type": "tool", "name": "g"}, {"type": "function", "function": {"name": "g"}})]:
        assert to_chat(minimal(tools=tools, tool_choice=choice)).chat["tool_choice"] == expected
    chat = to_chat(minimal(tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True})).chat
    assert chat["parallel_tool_calls"] is False
    only_server = to_chat(minimal(tools=tools[2:], tool_choice={"type": "auto"})).chat
    assert "tools" not in only_server and "tool_choice" not in only_server


def test_structured_outputs_translate() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    expected = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    assert to_chat(minimal(output_format={"type": "json_schema", "schema": schema})).chat["response_format"] == expected
    assert to_chat(minimal(output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"})).chat[
        "response_format"] == expected
    assert "response_format" not in to_chat(minimal(output_config={"effort": "low"})).chat
    strict = to_chat(minimal(tools=[{"name": "f", "input_schema": schema, "strict": True}])).chat["tools"]
    assert strict[0]["function"]["strict"] is True
    assert refusal(minimal(output_format={"type": "json_schema"}))["error"]["message"]


def test_sampling_fields() -> None:
    chat = to_chat(minimal(stop_sequences=["END", "\n\n"], temperature=0.2, top_p=0.9, top_k=40,
                           service_tier="auto", stream=False)).chat
    assert {k: chat[k] for k in ("stop", "temperature", "top_p", "top_k", "max_tokens", "stream")} == {
        "stop": ["END", "\n\n"], "temperature": 0.2, "top_p": 0.9, "top_k": 40, "max_tokens": 64,
        "stream": False}
    assert "stream_options" not in chat


@pytest.mark.parametrize("headers, user_id, expected", [
    ({"X-Claude-Code-Session-Id": "from-header"}, json.dumps({"session_id": "from-metadata"}), "from-header"),
    ({}, json.dumps({"device_id": "d", "session_id": "from-metadata"}), "from-metadata"),
    ({}, "user_abc_account__session_0d6b", "user_abc_account__session_0d6b"),
    ({}, json.dumps({"device_id": "d"}), json.dumps({"device_id": "d"})),
    ({}, None, None),
])
def test_the_session(headers: dict[str, str], user_id: str | None, expected: str | None) -> None:
    body = minimal(metadata={"user_id": user_id} if user_id is not None else {})
    assert to_chat(body, headers).session == expected


HOSTILE: dict[str, Any] = {
    "not an object": [1, 2],
    "no max_tokens": {"model": "m", "messages": USER},
    "max_tokens negative": minimal(max_tokens=-1),
    "max_tokens zero": minimal(max_tokens=0),
    "max_tokens huge": minimal(max_tokens=2**63),
    "max_tokens a string": minimal(max_tokens="lots"),
    "no messages": minimal(messages=[]),
    "messages a string": minimal(messages="hi"),
    "system role with a tool result": minimal(messages=[{"role": "system", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]),
    "content a number": minimal(messages=[{"role": "user", "content": 5}]),
    "block a string": minimal(messages=[{"role": "user", "content": ["hi"]}]),
    "block without type": minimal(messages=[{"role": "user", "content": [{"text": "hi"}]}]),
    "block type a number": minimal(messages=[{"role": "user", "content": [{"type": 3}]}]),
    "unknown block": minimal(messages=[{"role": "user", "content": [{"type": "hologram"}]}]),
    "server tool block": minimal(messages=[{"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}]}]),
    "text not a string": minimal(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
    "image": minimal(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]),
    "document": minimal(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
    "image in a tool result": minimal(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}]),
    "tool_use input a list": minimal(messages=[{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]),
    "tool_use input a string": minimal(messages=[{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": '{"a": 1}'}]}]),
    "tool_use without id": minimal(messages=[{"role": "assistant", "content": [
        {"type": "tool_use", "name": "f", "input": {}}]}]),
    "tool_use from the user": minimal(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
    "tool_result from the assistant": minimal(messages=[{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]),
    "tool_result content a number": minimal(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": 7}]}]),
    "system a number": minimal(system=5),
    "system image block": minimal(system=[{"type": "image", "source": {}}]),
    "cache_control unknown type": minimal(system=[{"type": "text", "text": "x", "cache_control": {"type": "x"}}]),
    "tools not a list": minimal(tools={"name": "f"}),
    "tool a string": minimal(tools=["f"]),
    "tool without schema": minimal(tools=[{"name": "f"}]),
    "tool with an empty name": minimal(tools=[{"name": "", "input_schema": {}}]),
    "tool_choice unknown": minimal(tools=[{"name": "f", "input_schema": {}}], tool_choice={"type": "all"}),
    "tool_choice tool without a name": minimal(tools=[{"name": "f", "input_schema": {}}],
                                               tool_choice={"type": "tool"}),
    "tool_choice any without tools": minimal(tool_choice={"type": "any"}),
    "temperature negative": minimal(temperature=-1),
    "temperature NaN": minimal(temperature=float("nan")),
    "top_p over one": minimal(top_p=2),
    "top_k negative": minimal(top_k=-3),
    "stop_sequences a string": minimal(stop_sequences="END"),
    "metadata user_id a number": minimal(metadata={"user_id": 5}),
    "thinking a string": minimal(thinking="yes"),
    "stream an object": minimal(stream={"on": True}),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_requests_are_400s_in_anthropic_shape(name: str) -> None:
    body = refusal(HOSTILE[name])
    assert body["error"]["message"] and set(body) == {"type", "error"}


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _paths(child, (*path, key))


def _replaced(body: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    out = copy.copy(body)
    out[path[0]] = _replaced(body[path[0]], path[1:], value)
    return out


def test_any_field_of_a_claude_code_request_swapped_for_junk_is_served_or_a_400() -> None:
    """Every value of a Claude Code body, in turn, replaced by a value of another type: the
    adapter and the chat form take it or refuse it with a 400, never anything else."""
    history = [{"role": "user", "content": [{"type": "text", "text": "Fix add.", "cache_control": {"type": "ephemeral"}}]},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                                 {"type": "tool_use", "id": "t1", "name": "Read",
                                                  "input": {"file_path": "calc.py"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": False,
                                             "content": [{"type": "text", "text": "def add(a, b):"}]}]}]
    body = claude_code.body(history, tools=claude_code.TOOLS[:2], stop_sequences=["END"])
    adapter = MessagesAdapter()
    cases = 0
    for path in _paths(body):
        if "input_schema" in path or "input" in path[:-1]:
            continue  # a schema's or a call's own content is free-form JSON
        for junk in (None, 7, -1, 2**70, 0.5, "x", True, [], {}, [{}], {"type": "x"}):
            cases += 1
            try:
                chat = asyncio.run(adapter.to_chat(_replaced(body, path, junk), {})).chat
                ChatCompletionRequest.model_validate(chat)
            except APIError as exc:
                assert exc.status == 400, (path, junk, exc.message)
            except ValidationError:
                pass  # the chat form's own check: the server answers it with a 400 (chat_request)
    assert cases > 500


def test_refusals_name_the_block() -> None:
    assert "messages.0.content.0" in refusal(HOSTILE["image"])["error"]["message"]
    assert "text only" in refusal(HOSTILE["image"])["error"]["message"]
    assert "'hologram'" in refusal(HOSTILE["unknown block"])["error"]["message"]
    assert "messages.0.content.0.input" in refusal(HOSTILE["tool_use input a list"])["error"]["message"]
    assert "max_tokens" in refusal(HOSTILE["no max_tokens"])["error"]["message"]


def test_count_tokens_needs_no_max_tokens() -> None:
    translated = asyncio.run(MessagesAdapter().count_chat(
        {"model": "m", "messages": USER, "system": claude_code.system(), "tools": claude_code.TOOLS}, {}))
    assert "max_tokens" not in translated.chat and len(translated.chat["tools"]) == 12
    refusal({"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]}, count=True)


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "request_too_large"), (422, "invalid_request_error"),
    (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"), (503, "overloaded_error"),
    (529, "overloaded_error"),
])
def test_error_types_by_status(status: int, kind: str) -> None:
    assert MessagesAdapter().error_body(status, error_body(status, "why")) == {
        "type": "error", "error": {"type": kind, "message": "why"}}


# --- replies and streams -----------------------------------------------------------------
CHAT_USAGE = {"prompt_tokens": 120, "completion_tokens": 17, "total_tokens": 137,
              "prompt_tokens_details": {"cached_tokens": 64, "cache_write_tokens": 40}}
WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_usage_adds_up_to_the_prompt() -> None:
    assert usage(CHAT_USAGE) == {"input_tokens": 16, "output_tokens": 17, "cache_creation_input_tokens": 40,
                                 "cache_read_input_tokens": 64}
    assert usage({"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}) == {
        "input_tokens": 9, "output_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def chat_reply(content: str, calls: list[tuple[str, str, str]], finish: str, matched: Any = None) -> dict[str, Any]:
    """The worker's whole reply for this output (content None beside calls when it says nothing)."""
    message: dict[str, Any] = {"role": "assistant", "content": content if content.strip() or not calls else None}
    if calls:
        message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, n, a in calls]
    return {"id": "chatcmpl-abc123", "object": "chat.completion", "created": 1, "model": "smollm2-135m",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
                         "stop_reason": matched}], "usage": CHAT_USAGE}


def chat_chunks(content: list[str], calls: list[tuple[str, str, list[str]]], finish: str,
                matched: Any = None) -> list[dict[str, Any]]:
    """The worker's stream for the same output: content pieces, then each call's pieces (id and
    name on the first), the finish (with the matched stop, as vLLM sends it), the usage."""
    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        return {"id": "chatcmpl-abc123", "object": "chat.completion.chunk", "created": 1,
                "model": "smollm2-135m", "choices": choices, "usage": usage}

    def delta(d: dict[str, Any]) -> dict[str, Any]:
        return chunk([{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}])

    out = [delta({"role": "assistant", "content": ""})]
    out += [delta({"content": piece}) for piece in content if piece]
    for index, (call_id, name, pieces) in enumerate(calls):
        for n, piece in enumerate(pieces):
            call: dict[str, Any] = {"index": index, "function": {"arguments": piece}}
            if n == 0:
                call.update(id=call_id, type="function")
                call["function"]["name"] = name
            out.append(delta({"tool_calls": [call]}))
    final = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
    if matched is not None:
        final["stop_reason"] = matched
    out.append(chunk([final]))
    out.append(chunk([], CHAT_USAGE))
    return out


def stream_events(translated: MessagesTranslated, chunks: list[dict[str, Any]]) -> list[str]:
    translator = MessagesAdapter().stream(translated)
    events = [event for chunk in chunks for event in translator.feed(copy.deepcopy(chunk))]
    return events + translator.close()


CASES: dict[str, dict[str, Any]] = {
    "text and two calls": {
        "content": "Let me check both cities.\n",
        "calls": [("call_1", "get_weather", '{"city": "Tokyo"}'),
                  ("call_2", "get_weather", '{"city": "Paris, \\"FR\\" — 巴黎"}')],
        "finish": "tool_calls", "body": {"tools": [WEATHER]}},
    "thinking then text, a stop sequence": {
        "content": "<think>A haiku about\nautumn.</think>\n\nLeaves fall on the pond, ✓ ripples",
        "calls": [], "finish": "stop", "matched": "END",
        "body": {"thinking": {"type": "adaptive"}, "stop_sequences": ["END"]}},
    "thinking then a call": {
        "content": "<think>I need the tool.</think>\n", "calls": [("call_9", "get_weather", '{"city": "Oslo"}')],
        "finish": "tool_calls", "body": {"thinking": {"type": "enabled", "budget_tokens": 1024}, "tools": [WEATHER]}},
    "whitespace and a call": {
        "content": "\n\n", "calls": [("call_3", "get_weather", '{"city": "Lima"}')],
        "finish": "tool_calls", "body": {"tools": [WEATHER]}},
    "unfinished thinking": {
        "content": "<think>still thinking </thi", "calls": [], "finish": "length",
        "body": {"thinking": {"type": "adaptive"}}},
    "almost a think tag": {
        "content": "<thi", "calls": [], "finish": "stop", "matched": 2,
        "body": {"thinking": {"type": "adaptive"}, "stop_sequences": ["<thi"]}},
    "thinking not requested": {
        "content": "<think>x</think> y  ", "calls": [], "finish": "stop", "body": {}},
    "nothing": {"content": "", "calls": [], "finish": "stop", "body": {}},
    "only whitespace": {"content": " \n", "calls": [], "finish": "length", "body": {}},
}


def splits(text: str) -> list[list[str]]:
    """The text cut at each character boundary, and cut into single characters."""
    return [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]


@pytest.mark.parametrize("name", list(CASES))
def test_the_stream_accumulates_to_the_reply_at_every_split_point(name: str) -> None:
    case = CASES[name]
    translated = to_chat(minimal(stream=True, **case["body"]))
    calls, matched = case["calls"], case.get("matched")
    expected = asyncio.run(MessagesAdapter().reply(chat_reply(case["content"], calls, case["finish"], matched),
                                                   translated))
    whole = [(i, n, [a]) for i, n, a in calls]
    streams = [chat_chunks(pieces, whole, case["finish"], matched) for pieces in splits(case["content"])]
    for index, (call_id, call_name, arguments) in enumerate(calls):
        for pieces in splits(arguments):
            split = [*whole[:index], (call_id, call_name, pieces), *whole[index + 1:]]
            streams.append(chat_chunks([case["content"]], split, case["finish"], matched))
    for chunks in streams:
        assert accumulate(stream_events(translated, chunks)) == expected, chunks


@pytest.mark.parametrize("requested", [True, False], ids=["thinking", "no-thinking"])
def test_a_servers_reasoning_content_is_the_thinking_block(requested: bool) -> None:
    """A worker started with --reasoning-parser sends the reasoning apart (`reasoning_content`):
    it becomes the thinking block, whole or streamed, when thinking was asked for, and is left
    out when it was not (as Anthropic leaves thinking out)."""
    body = {"thinking": {"type": "adaptive"}} if requested else {}
    translated = to_chat(minimal(stream=True, **body))
    reply = chat_reply("The answer is 4.", [], "stop")
    reply["choices"][0]["message"]["reasoning_content"] = "2 + 2 is 4."
    whole = asyncio.run(MessagesAdapter().reply(reply, translated))
    expected = ([{"type": "thinking", "thinking": "2 + 2 is 4.", "signature": ""}] if requested else []) + [
        {"type": "text", "text": "The answer is 4."}]
    assert whole["content"] == expected
    chunks = chat_chunks(["The answer is 4."], [], "stop")
    reasoning = [{**chunks[0], "choices": [{"index": 0, "delta": {"reasoning_content": piece}, "logprobs": None,
                                            "finish_reason": None}]} for piece in ("2 + 2 ", "is 4.")]
    assert accumulate(stream_events(translated, [chunks[0], *reasoning, *chunks[1:]])) == whole


def test_text_after_a_call_is_a_block_of_its_own_in_a_stream() -> None:
    """The one difference between a stream and its whole reply: a stream cannot put text that
    comes after a call before it. No text is lost: the text blocks join to the reply's text."""
    translated = to_chat(minimal(stream=True, tools=[WEATHER]))
    content, calls = ["Sure.\n", "\nDone. "], [("call_1", "get_weather", ['{"city": "Rome"}'])]
    chunks = chat_chunks(content[:1], calls, "tool_calls")
    chunks.insert(-2, chat_chunks(content[1:], [], "tool_calls")[1])  # text after the call
    streamed = accumulate(stream_events(translated, chunks))
    reply = asyncio.run(MessagesAdapter().reply(chat_reply("".join(content), [
        ("call_1", "get_weather", '{"city": "Rome"}')], "tool_calls"), translated))
    assert [b["type"] for b in streamed["content"]] == ["text", "tool_use", "text"]
    assert [b["type"] for b in reply["content"]] == ["text", "tool_use"]
    assert "".join(b["text"] for b in streamed["content"] if b["type"] == "text") == reply["content"][0]["text"]
    assert streamed["content"][1] == reply["content"][1]


def test_replies_say_what_the_output_was() -> None:
    translated = to_chat(minimal(tools=[WEATHER], thinking={"type": "adaptive"}, stop_sequences=["END"]))
    reply = asyncio.run(MessagesAdapter().reply(chat_reply(*(
        "<think>hm</think>\nSure.\n", [("call_1", "get_weather", '{"city": "Tokyo"}')], "tool_calls")), translated))
    assert reply == {
        "id": "msg_abc123", "type": "message", "role": "assistant", "model": "smollm2-135m",
        "content": [{"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "Sure."},
                    {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Tokyo"}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 16, "output_tokens": 17, "cache_creation_input_tokens": 40,
                  "cache_read_input_tokens": 64}}
    for finish, matched, expected in [("stop", "END", ("stop_sequence", "END")), ("stop", None, ("end_turn", None)),
                                      ("stop", "</tool_call>", ("end_turn", None)),  # not the client's
                                      ("stop", 2, ("end_turn", None)), ("length", None, ("max_tokens", None)),
                                      ("abort", None, ("end_turn", None))]:
        reply = asyncio.run(MessagesAdapter().reply(chat_reply("x", [], finish, matched), translated))
        assert (reply["stop_reason"], reply["stop_sequence"]) == expected


def test_the_stream_is_in_anthropic_order() -> None:
    translated = to_chat(minimal(stream=True, tools=[WEATHER]))
    events = parse_events(stream_events(translated, chat_chunks(
        ["Hi", " there"], [("call_1", "get_weather", ['{"city": ', '"Rome"}'])], "tool_calls")))
    assert [name for name, _ in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["id"] == "msg_abc123" and start["content"] == [] and start["model"] == "smollm2-135m"
    assert events[6][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert events[7][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": '}
    assert events[10][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[10][1]["usage"] == usage(CHAT_USAGE)  # input and cache counts too, exact


def test_an_error_mid_stream_is_the_last_event() -> None:
    translator = MessagesAdapter().stream(to_chat(minimal(stream=True)))
    events = translator.feed(chat_chunks(["Hi"], [], "stop")[0]) + translator.feed(chat_chunks(["Hi"], [], "stop")[1])
    events += translator.error(error_body(503, "the engine is not running", None, "engine_dead"))
    assert translator.feed(chat_chunks(["more"], [], "stop")[1]) == [] and translator.close() == []
    parsed = parse_events(events)
    assert [name for name, _ in parsed] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                            "error"]
    assert parsed[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "the engine is not running"}}
    early = MessagesAdapter().stream(to_chat(minimal(stream=True)))
    assert parse_events(early.error({"error": {"message": "slow down", "type": "rate_limit_error", "code": 429}})) == [
        ("error", {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}})]


@pytest.mark.parametrize("text", ["<think>a</think>b", "<think>", "<thin", "x<think>y", "<think>a</thi", ""])
def test_the_think_splitter_holds_back_only_what_may_be_a_tag(text: str) -> None:
    for k in range(len(text) + 1):
        splitter = ThinkSplitter(True)
        splitter.feed(text[:k])
        held = splitter.held
        assert held == "" or "<think>".startswith(held) or "</think>".startswith(held), (text[:k], held)


FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("name", ["claude_code_messages.json", "claude_code_messages_turn2.json"])
def test_what_claude_code_really_sends_is_served(name: str) -> None:
    """Requests recorded from Claude Code 2.1.332 (fixtures/README.md): its messages[1] is a
    mid-conversation system message, which must stay a system message in its place."""
    recorded = json.loads((FIXTURES / name).read_text())
    translated = to_chat(recorded["body"], recorded["headers"])
    sent = recorded["body"]["messages"]
    chat_roles = [m["role"] for m in translated.chat["messages"]]
    assert chat_roles[0] == "system"  # the system blocks, billing header left out
    assert [m["role"] for m in sent][:2] == ["user", "system"]
    assert chat_roles[1:3] == ["user", "system"]
    assert translated.session == recorded["headers"]["x-claude-code-session-id"]


def test_tandems_chat_extras_reach_the_chat_request() -> None:
    """`ignore_eos`, `cache_salt` and the other vLLM-style extras the chat endpoint takes pass
    through, so a benchmark generates exactly max_tokens in every protocol and can keep runs'
    caches apart; their ranges are the chat request's own (a negative min_tokens, an empty
    salt are refused there)."""
    chat = to_chat(minimal(ignore_eos=True, seed=7, min_tokens=2, cache_salt="run-2")).chat
    assert (chat["ignore_eos"], chat["seed"], chat["min_tokens"], chat["cache_salt"]) == (True, 7, 2, "run-2")
    with pytest.raises(ValidationError):
        to_chat(minimal(min_tokens=-1))
    with pytest.raises(ValidationError):
        to_chat(minimal(cache_salt=""))
