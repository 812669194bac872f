"""The Responses adapter (tandem/edge/protocols/openai_responses.py) on its own: requests into
the chat form, chat replies and chunk streams back, the store, and hostile input.

Shapes are checked against the openai SDK's own pydantic models (`Response`,
`ResponseStreamEvent`), validated strictly, so a field the SDK needs cannot go missing. The
stream is checked against the whole reply at every split point of its text and arguments.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from tandem.edge.errors import APIError
from tandem.edge.openai_protocol import ChatCompletionRequest
from tandem.edge.protocols.base import sse_event, translate_sse
from tandem.edge.protocols.openai_responses import OpenAIResponsesAdapter
from tandem.edge.protocols.response_store import (
    MemoryResponseStore,
    ResponseStoreError,
    StoredResponse,
)
from tandem.edge.protocols.responses_models import ResponsesTranslated

EVENT = TypeAdapter(ResponseStreamEvent)
USAGE = {"prompt_tokens": 41, "completion_tokens": 17, "total_tokens": 58,
         "prompt_tokens_details": {"cached_tokens": 32}}

CODEX_TOOLS = [
    {"type": "function", "name": "shell_command", "description": "Runs a shell command", "strict": False,
     "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                    "required": ["command"], "additionalProperties": False}},
    {"type": "namespace", "name": "mcp__docs__", "description": "Tools of the docs MCP server",
     "tools": [{"type": "function", "name": "search", "description": "Search the docs", "strict": False,
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
               {"type": "custom", "name": "raw", "description": "freeform"}]},
    {"type": "web_search", "external_web_access": False},
    {"type": "custom", "name": "apply_patch", "description": "Apply a patch",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
]


def codex_body(**changes: Any) -> dict[str, Any]:
    """What Codex CLI sends on a turn (wire_api = "responses")."""
    body = {
        "model": "qwen2.5-coder-0.5b",
        "instructions": "You are Codex, a coding agent.",
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "<permissions instructions>"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "<environment_context>cwd=/repo</environment_context>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA..."},
        ],
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a7f0-session",
        "text": {"verbosity": "medium"},
        "service_tier": None,
        "client_metadata": {"x-codex-turn": "1"},
    }
    body.update(changes)
    return body


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture
def adapter() -> OpenAIResponsesAdapter:
    return OpenAIResponsesAdapter(MemoryResponseStore())


def translate(adapter: OpenAIResponsesAdapter, body: dict[str, Any],
              headers: dict[str, str] | None = None) -> ResponsesTranslated:
    translated = run(adapter.to_chat(body, headers or {}))
    assert isinstance(translated, ResponsesTranslated)
    ChatCompletionRequest.model_validate(translated.chat)  # the chat path takes what it makes
    return translated


def refused(adapter: OpenAIResponsesAdapter, body: Any, status: int = 400) -> APIError:
    with pytest.raises(APIError) as caught:
        run(adapter.to_chat(body, {}))
    assert caught.value.status == status, caught.value.message
    assert set(caught.value.body()["error"]) == {"message", "type", "param", "code"}
    return caught.value


def chat_reply(content: str | None, calls: list[tuple[str, str, str]] = (), finish: str = "stop",
               model: str = "qwen2.5-coder-0.5b") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                                 for cid, name, args in calls]
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": USAGE}


def events_of(sse: list[str]) -> list[dict[str, Any]]:
    """Each SSE string as its data, checked against its `event:` line and the SDK's model."""
    out = []
    for text in sse:
        head, data = text.split("\n", 1)
        assert text.endswith("\n\n") and head.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == head[len("event: "):]
        EVENT.validate_python(payload)
        out.append(payload)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


# --- requests ----------------------------------------------------------------------------


def test_a_string_input_is_one_user_message(adapter: OpenAIResponsesAdapter) -> None:
    t = translate(adapter, {"model": "m", "input": "Hello", "max_output_tokens": 20, "temperature": 0,
                            "top_p": 0.5, "user": "u1"})
    assert t.chat == {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "stream": False,
                      "max_tokens": 20, "temperature": 0, "top_p": 0.5, "user": "u1"}
    assert t.dropped == [] and t.response_id.startswith("resp_") and t.store is True


def test_every_input_item_type(adapter: OpenAIResponsesAdapter) -> None:
    body = {"instructions": "Be brief.", "input": [
        {"type": "message", "role": "system", "content": "sys"},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "dev"}]},
        {"role": "user", "content": "short form"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "search", "namespace": "mcp__docs__",
         "arguments": {"q": "x"}},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "hit 1"}, {"type": "input_text", "text": "hit 2"}]},
        {"type": "function_call", "call_id": "c3", "name": "ls", "arguments": "{\"path\": \"/\"}"},
        {"type": "function_call_output", "call_id": "c3", "output": {"files": []}},
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
    ]}
    t = translate(adapter, body)
    assert t.chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "sys"},
        {"role": "developer", "content": "dev"},
        {"role": "user", "content": "short form"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "mcp__docs__search", "arguments": '{"q": "x"}'}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "c2", "content": "hit 1\nhit 2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "ls", "arguments": '{"path": "/"}'}}]},
        {"role": "tool", "tool_call_id": "c3", "content": '{"files": []}'},
        {"role": "assistant", "content": "No."},
    ]
    assert t.dropped == ["reasoning items", "input items of type web_search_call"]


def test_a_reasoning_items_text_goes_back_as_the_next_assistant_turns_reasoning(adapter: OpenAIResponsesAdapter) -> None:
    """The reasoning items tandem's replies hold (`reasoning_text` parts) are the model's own
    thinking for the calls after them: a thinking model's template renders them for the turn
    in progress, so they reach the chat request as that assistant message's reasoning."""
    body = {"input": [
        {"role": "user", "content": "List the files."},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "I should call ls."}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
    ]}
    t = translate(adapter, body)
    assert t.chat["messages"][1] == {"role": "assistant", "content": None, "reasoning_content": "I should call ls.",
                                     "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "ls", "arguments": "{}"}}]}
    assert t.dropped == []
    junk = {"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 7}]}]}
    with pytest.raises(APIError, match=r"input\[0\].content\[0\].text"):
        translate(adapter, junk)

def test_a_codex_request_is_accepted_with_hosted_tools_dropped(adapter: OpenAIResponsesAdapter) -> None:
    t = translate(adapter, codex_body(), {"session-id": "0199a7f0-session", "originator": "codex_cli_rs"})
    assert [tool["function"]["name"] for tool in t.chat["tools"]] == ["shell_command", "mcp__docs__search"]
    assert t.chat["tools"][0]["function"] == {"name": "shell_command", "description": "Runs a shell command",
                                              "parameters": CODEX_TOOLS[0]["parameters"]}  # no strict
    assert t.chat["tool_choice"] == "auto" and t.chat["parallel_tool_calls"] is False
    assert t.chat["stream"] is True and t.chat["stream_options"] == {"include_usage": True}
    assert [m["role"] for m in t.chat["messages"]] == ["system", "developer", "user", "user"]
    assert t.dropped == ["reasoning items", "tool custom in namespace mcp__docs__", "tool web_search", "tool custom"]
    assert t.session == "0199a7f0-session" and t.store is False


def test_media_parts_are_refused_not_dropped(adapter: OpenAIResponsesAdapter) -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    error = refused(adapter, {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}, image]}]})
    assert error.param == "input[0].content[1]" and "text only" in error.message
    error = refused(adapter, {"input": [{"type": "function_call_output", "call_id": "c",
                                         "output": [{"type": "input_file", "file_id": "f"}]}]})
    assert error.param == "input[0].output[0]"


def test_tool_choice(adapter: OpenAIResponsesAdapter) -> None:
    tools = [{"type": "function", "name": "a"}, {"type": "function", "name": "b"},
             {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "c"}]}]

    def choice(value: Any) -> tuple[Any, list[str], list[str]]:
        t = translate(adapter, {"input": "x", "tools": tools, "tool_choice": value})
        return t.chat.get("tool_choice"), [x["function"]["name"] for x in t.chat["tools"]], t.dropped

    assert choice("required") == ("required", ["a", "b", "ns__c"], [])
    assert choice("none")[0] == "none"
    assert choice({"type": "function", "name": "b"})[0] == {"type": "function", "function": {"name": "b"}}
    assert choice({"type": "function", "name": "c", "namespace": "ns"})[0] == {
        "type": "function", "function": {"name": "ns__c"}}
    assert choice({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "a"}]})[:2] \
        == ("required", ["a"])
    assert choice({"type": "web_search_preview"}) == ("auto", ["a", "b", "ns__c"], ["tool_choice web_search_preview"])
    assert refused(adapter, {"input": "x", "tools": tools, "tool_choice": {"type": "function", "name": "zz"}}).param \
        == "tool_choice.name"
    assert refused(adapter, {"input": "x", "tools": tools, "tool_choice": "sometimes"}).param == "tool_choice"
    # Without tools nothing is chosen: "required" over only hosted tools is not a refusal.
    t = translate(adapter, {"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "required"})
    assert "tools" not in t.chat and "tool_choice" not in t.chat


def test_text_format_becomes_the_chat_response_format(adapter: OpenAIResponsesAdapter) -> None:
    plain = translate(adapter, {"input": "x", "text": {"format": {"type": "text"}, "verbosity": "low"}})
    assert "response_format" not in plain.chat
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    flat = {"type": "json_schema", "name": "o", "schema": schema, "strict": True}
    assert translate(adapter, {"input": "x", "text": {"format": flat}}).chat["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "o", "schema": schema, "strict": True}}
    assert translate(adapter, {"input": "x", "text": {"format": {"type": "json_object"}}}).chat[
        "response_format"] == {"type": "json_object"}
    error = refused(adapter, {"input": "x", "text": {"format": {"type": "json_schema", "name": "o", "schema": 3}}})
    assert error.param == "text.format.schema"
    assert refused(adapter, {"input": "x", "text": {"format": {"type": "xml"}}}).param == "text.format.type"


def test_session_precedence(adapter: OpenAIResponsesAdapter) -> None:
    body = {"input": "x", "prompt_cache_key": "key", "user": "user"}
    assert translate(adapter, body, {"session-id": "header"}).session == "header"
    assert translate(adapter, body, {"session_id": "underscore"}).session == "underscore"
    assert translate(adapter, body).session == "key"
    assert translate(adapter, {"input": "x", "user": "user"}).session == "user"
    assert translate(adapter, {"input": "x"}).session is None
    first = translate(adapter, {"input": "x", "prompt_cache_key": "stored-session"})
    run(adapter.reply(chat_reply("ok"), first))
    follow = translate(adapter, {"input": "y", "previous_response_id": first.response_id, "user": "user"})
    assert follow.session == "stored-session"


def test_what_is_dropped_can_be_sent_in_a_header(adapter: OpenAIResponsesAdapter) -> None:
    t = translate(adapter, {"input": [{"type": "x\r\nSet-Cookie: a=b"}, {"role": "user", "content": "hi"}], "tools": [
        {"type": "web_search🙂"}, {"type": "namespace", "name": "n\u00e9\n", "tools": [{"type": "custom\x00"}]}]})
    assert t.dropped == ["input items of type x??Set-Cookie: a=b", "tool web_search?", "tool custom? in namespace n??"]
    assert all(note.isascii() and note.isprintable() for note in t.dropped)


def test_unknown_fields_are_tolerated(adapter: OpenAIResponsesAdapter) -> None:
    t = translate(adapter, {"input": "x", "metadata": {"a": "b"}, "truncation": "auto", "safety_identifier": "s",
                            "service_tier": "flex", "max_tool_calls": 3, "top_logprobs": 2, "background": True,
                            "stream_options": {"include_obfuscation": False}, "prompt": {"id": "p"},
                            "some_future_field": {"x": [1]}, "seed": 7, "ignore_eos": True})
    assert t.chat["seed"] == 7 and t.chat["ignore_eos"] is True and t.dropped == ["background"]


HOSTILE: list[Any] = [
    {"input": 5}, {"input": [5]}, {"input": [{"type": 5}]}, {"input": [{}]},
    {"input": [{"role": "robot", "content": "x"}]}, {"input": [{"role": "user", "content": 5}]},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
    {"input": [{"role": "user", "content": [{"type": "mystery"}]}]},
    {"input": [{"role": "user", "content": [7]}]},
    {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
    {"input": [{"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}]},
    {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 5}]},
    {"input": [{"type": "function_call_output", "call_id": "c"}]},
    {"input": [{"type": "function_call_output", "output": "x"}]},
    {"input": "x", "tools": "all"}, {"input": "x", "tools": [5]}, {"input": "x", "tools": [{"type": 3}]},
    {"input": "x", "tools": [{"type": "function"}]}, {"input": "x", "tools": [{"type": "function", "name": 5}]},
    {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "x"}]},
    {"input": "x", "tools": [{"type": "function", "name": "f", "description": 3}]},
    {"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": 3}]},
    {"input": "x", "tools": [{"type": "namespace", "tools": []}]},
    {"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [3]}]},
    {"input": "x", "tool_choice": 3}, {"input": "x", "tool_choice": {"type": None}},
    {"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "always", "tools": []}},
    {"input": "x", "tool_choice": {"type": "allowed_tools", "tools": 5}},
    {"input": "x", "text": "plain"}, {"input": "x", "text": {"format": {"type": "xml"}}},
    {"input": "x", "max_output_tokens": 0}, {"input": "x", "max_output_tokens": "20"},
    {"input": "x", "max_output_tokens": True}, {"input": "x", "max_output_tokens": 2**40},
    {"input": "x", "stream": "yes"}, {"input": "x", "store": 1}, {"input": "x", "parallel_tool_calls": "no"},
    {"input": "x", "model": 3}, {"input": "x", "instructions": ["a"]}, {"input": "x", "user": 5},
    {"input": "x", "previous_response_id": 5}, {}, {"input": []}, {"input": None},
]


@pytest.mark.parametrize("body", HOSTILE, ids=[json.dumps(b)[:60] for b in HOSTILE])
def test_hostile_requests_are_refused_in_openai_shape(adapter: OpenAIResponsesAdapter, body: Any) -> None:
    refused(adapter, body)


VALUES: list[Any] = [None, True, 0, -1, 2**70, 1.5, float("1e308"), "", "x" * 3, [], [None], [{}], {},
                     {"type": None}, {"type": "function"}, [{"type": "function", "name": "f"}],
                     [{"role": "user", "content": [{}]}], [{"type": "message"}], "\ud800"]
FIELDS = ["input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "temperature",
          "top_p", "stream", "store", "parallel_tool_calls", "previous_response_id", "user", "model",
          "reasoning", "include", "metadata", "prompt_cache_key", "seed", "stop"]


@pytest.mark.parametrize("field", FIELDS)
def test_any_value_in_any_field_is_answered_or_refused(adapter: OpenAIResponsesAdapter, field: str) -> None:
    """Never anything but an APIError (the chat model's ValidationError is a 400 there too),
    and whatever is accepted is answered whole and streamed without an exception."""
    for value in VALUES:
        body = {"input": "x", field: value}
        try:
            t = run(adapter.to_chat(body, {}))
        except APIError as exc:
            assert exc.status in (400, 404), (field, value, exc.message)
            continue
        try:
            ChatCompletionRequest.model_validate(t.chat)
        except ValidationError:
            continue
        json.dumps(run(adapter.reply(chat_reply("ok", [("c", "f", "{}")]), t)))
        stream = adapter.stream(t)
        for chunk in chunks_of(chat_reply("ok", [("c", "f", "{}")])):
            stream.feed(chunk)
        stream.close()


# --- replies and streams -----------------------------------------------------------------


def test_reply_is_an_sdk_response(adapter: OpenAIResponsesAdapter) -> None:
    t = translate(adapter, {"model": "m", "input": "x", "tools": CODEX_TOOLS, "instructions": "i",
                            "temperature": 0.2, "metadata": {"k": "v"}})
    response = run(adapter.reply(chat_reply("Sure.", [("call_9", "mcp__docs__search", '{"q": "a"}'),
                                                      ("call_10", "shell_command", '{"command": "ls"}')],
                                            "tool_calls"), t))
    parsed = Response.model_validate(response)
    assert parsed.id == t.response_id and parsed.status == "completed" and parsed.model == "qwen2.5-coder-0.5b"
    assert parsed.output_text == "Sure."
    message, search, shell = response["output"]
    assert message["id"].startswith("msg_") and message["content"][0]["annotations"] == []
    assert (search["name"], search["namespace"], search["call_id"]) == ("search", "mcp__docs__", "call_9")
    assert (shell["name"], "namespace" not in shell) == ("shell_command", True)
    assert search["id"].startswith("fc_") and search["status"] == shell["status"] == "completed"
    assert response["usage"] == {"input_tokens": 41, "input_tokens_details": {"cached_tokens": 32, "cache_write_tokens": 0},
                                 "output_tokens": 17, "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": 58}
    assert (parsed.instructions, parsed.temperature, parsed.metadata) == ("i", 0.2, {"k": "v"})
    assert len(parsed.tools) == len(CODEX_TOOLS)


def test_length_is_incomplete(adapter: OpenAIResponsesAdapter) -> None:
    t = translate(adapter, {"input": "x", "max_output_tokens": 5})
    response = run(adapter.reply(chat_reply("cut sh", finish="length"), t))
    Response.model_validate(response)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"


def chunks_of(reply: dict[str, Any], cuts: dict[int, list[int]] | None = None) -> list[dict[str, Any]]:
    """The chat chunk stream of a whole reply, as the chat path streams it: a role chunk, the
    content, each call (id and name first), the finish, the usage chunk. `cuts`: where to split
    the content (key -1) and each call's arguments (key: its index), at character offsets."""
    cuts = cuts or {}
    message = reply["choices"][0]["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": reply["id"], "object": "chat.completion.chunk", "created": 1, "model": reply["model"],
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], "usage": None}

    def pieces(text: str, at: list[int]) -> list[str]:
        bounds = [0, *sorted(at), len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": piece}) for piece in pieces(message.get("content") or "", cuts.get(-1, []))]
    for index, call in enumerate(message.get("tool_calls") or []):
        args = pieces(call["function"]["arguments"], cuts.get(index, []))
        first = {"index": index, "id": call["id"], "type": "function",
                 "function": {"name": call["function"]["name"], "arguments": args[0] if args else ""}}
        out.append(chunk({"tool_calls": [first]}))
        out += [chunk({"tool_calls": [{"index": index, "function": {"arguments": a}}]}) for a in args[1:]]
    out.append(chunk({}, reply["choices"][0]["finish_reason"]))
    out.append({"id": reply["id"], "object": "chat.completion.chunk", "created": 1, "model": reply["model"],
                "choices": [], "usage": reply["usage"]})
    return out


def stream_events(adapter: OpenAIResponsesAdapter, t: ResponsesTranslated,
                  chunks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Any]:
    stream = adapter.stream(t)
    sse = [event for chunk in chunks for event in stream.feed(chunk)] + stream.close()
    return events_of(sse), stream.final


def split_points() -> Iterator[tuple[str, dict[int, list[int]]]]:
    yield "whole", {}
    for at in range(1, len(TEXT)):
        yield f"text@{at}", {-1: [at]}
    for call, (_, _, args) in enumerate(CALLS):
        for at in range(1, len(args)):
            yield f"call{call}@{at}", {call: [at]}
    yield "every character", {-1: list(range(1, len(TEXT))),
                              **{i: list(range(1, len(a))) for i, (_, _, a) in enumerate(CALLS)}}


TEXT = "I'll look: é→ü 🙂."
CALLS = [("call_a", "mcp__docs__search", '{"q": "naïve \\"quoted\\""}'), ("call_b", "shell_command", '{"command":"ls"}')]


@pytest.mark.parametrize(("name", "cuts"), list(split_points()), ids=[n for n, _ in split_points()])
def test_stream_ends_with_the_whole_reply_at_every_split(adapter: OpenAIResponsesAdapter, name: str,
                                                          cuts: dict[int, list[int]]) -> None:
    t = translate(adapter, {"model": "m", "input": "x", "tools": CODEX_TOOLS, "stream": True, "store": False})
    reply = chat_reply(TEXT, CALLS, "tool_calls")
    whole = run(adapter.reply(copy.deepcopy(reply), t))
    events, final = stream_events(adapter, t, chunks_of(reply, cuts))
    assert final == whole
    assert events[-1] == {"type": "response.completed", "sequence_number": len(events) - 1, "response": whole}
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == TEXT
    for index, (call_id, _, args) in enumerate(CALLS):
        output_index = index + 1
        mine = [e for e in events if e.get("output_index") == output_index]
        added = mine[0]
        assert added["type"] == "response.output_item.added"
        assert added["item"]["call_id"] == call_id and added["item"]["arguments"] == ""
        deltas = "".join(e["delta"] for e in mine if e["type"] == "response.function_call_arguments.delta")
        assert deltas == args
        assert [e["type"] for e in mine[-2:]] == ["response.function_call_arguments.done", "response.output_item.done"]
        assert mine[-1]["item"] == whole["output"][output_index]
    # Items follow each other: each is done before the next is added.
    opened = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert opened == done == [0, 1, 2]
    assert not any(e["type"] == "response.output_text.delta" and "<tool_call>" in e["delta"] for e in events)


def test_a_servers_reasoning_content_is_a_reasoning_item_whole_and_streamed(adapter: OpenAIResponsesAdapter) -> None:
    """A worker started with --reasoning-parser sends its `<think>` text as reasoning_content:
    it becomes a reasoning item (one reasoning_text part) ahead of the message and the calls,
    the SDK's own types read it, and the stream ends with the whole reply at any split."""
    t = translate(adapter, {"model": "m", "input": "x", "tools": CODEX_TOOLS, "stream": True, "store": False})
    reply = chat_reply(TEXT, CALLS[:1], "tool_calls")
    reply["choices"][0]["message"]["reasoning_content"] = "Search first."
    whole = run(adapter.reply(copy.deepcopy(reply), t))
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message", "function_call"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "Search first."}]
    Response.model_validate(whole)
    chunks = chunks_of(reply)
    thinking = [{**chunks[0], "choices": [{"index": 0, "delta": {"reasoning_content": piece}, "logprobs": None,
                                           "finish_reason": None}]} for piece in ("Search ", "first.")]
    events, final = stream_events(adapter, t, [chunks[0], *thinking, *chunks[1:]])
    assert final == whole
    kinds = [e["type"] for e in events]
    assert kinds[2:6] == ["response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
                          "response.reasoning_text.done"]
    for event in events:
        TypeAdapter(ResponseStreamEvent).validate_python(event)


def test_stream_of_text_only_and_of_a_cut_response(adapter: OpenAIResponsesAdapter) -> None:
    t = translate(adapter, {"input": "x", "stream": True})
    reply = chat_reply("Hello there", finish="length")
    events, final = stream_events(adapter, t, chunks_of(reply, {-1: [3, 7]}))
    assert final == run(adapter.reply(copy.deepcopy(reply), t))
    assert events[-1]["type"] == "response.incomplete" and final["status"] == "incomplete"
    assert [e["type"] for e in events][4:9] == ["response.output_text.delta"] * 3 + [
        "response.output_text.done", "response.content_part.done"]


def test_an_error_mid_stream_is_response_failed(adapter: OpenAIResponsesAdapter) -> None:
    t = translate(adapter, {"input": "x", "stream": True})
    stream = adapter.stream(t)
    sse = stream.feed(chunks_of(chat_reply("Hi"))[1])
    sse += stream.error({"error": {"message": "the engine died", "type": "server_error", "param": None,
                                   "code": "engine_dead"}})
    sse += stream.close()
    events = events_of(sse)
    assert events[-1]["type"] == "response.failed" and stream.final is None
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "the engine died"}
    assert events[-1]["response"]["status"] == "failed"
    # Before any chunk, the stream still opens as the SDK requires; a 429 is rate_limit_exceeded.
    stream = adapter.stream(t)
    events = events_of(stream.error({"error": {"message": "full", "type": "rate_limit_error", "code": None}}))
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1]["response"]["error"]["code"] == "rate_limit_exceeded"
    # A chat stream that stops without a finish reason broke: failed, not completed.
    stream = adapter.stream(t)
    sse = [e for c in chunks_of(chat_reply("Hi"))[:2] for e in stream.feed(c)] + stream.close()
    assert events_of(sse)[-1]["type"] == "response.failed"


def test_translate_sse_stores_before_the_last_events_go_out(adapter: OpenAIResponsesAdapter) -> None:
    t = translate(adapter, {"input": "x", "stream": True})
    seen: list[str] = []

    async def chat_sse() -> Any:
        for chunk in chunks_of(chat_reply("Hi there")):
            yield sse_event(None, chunk)
        yield "data: [DONE]\n\n"

    async def main() -> None:
        stream = adapter.stream(t)

        async def stored() -> None:
            seen.append("finish")
            await adapter.finish(t, stream.final)

        async for event in translate_sse(chat_sse(), stream, stored):
            seen.append(event.split("\n", 1)[0])
        assert (await adapter.retrieve(t.response_id)) == stream.final

    run(main())
    # Stored before any of the closing events (the message's done events, then completed).
    assert seen[-5:] == ["finish", "event: response.output_text.done", "event: response.content_part.done",
                         "event: response.output_item.done", "event: response.completed"]


# --- the store ---------------------------------------------------------------------------


def test_previous_response_id_continues_the_stored_conversation(adapter: OpenAIResponsesAdapter) -> None:
    first = translate(adapter, {"instructions": "old", "input": "What is 2+2?", "tools": CODEX_TOOLS})
    answer = run(adapter.reply(chat_reply("Let me check.", [("call_1", "mcp__docs__search", "{}")], "tool_calls"),
                               first))
    assert run(adapter.retrieve(first.response_id)) == answer
    follow = translate(adapter, {"instructions": "new", "previous_response_id": first.response_id,
                                 "input": [{"type": "function_call_output", "call_id": "call_1", "output": "4"}]})
    assert follow.chat["messages"] == [
        {"role": "system", "content": "new"},  # instructions are not carried over
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "mcp__docs__search", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
    ]
    second = run(adapter.reply(chat_reply("4."), follow))
    assert second["previous_response_id"] == first.response_id
    third = translate(adapter, {"previous_response_id": second["id"], "input": "Thanks"})
    assert [m["role"] for m in third.chat["messages"]] == ["user", "assistant", "tool", "assistant", "user"]
    # Only a continuation: the previous response alone is a request too.
    assert len(translate(adapter, {"previous_response_id": second["id"]}).chat["messages"]) == 4


def test_store_false_keeps_nothing_and_unknown_ids_are_404(adapter: OpenAIResponsesAdapter) -> None:
    t = translate(adapter, {"input": "x", "store": False})
    run(adapter.reply(chat_reply("ok"), t))
    for unknown in (t.response_id, "resp_nope", "x" * 5000):
        with pytest.raises(APIError) as caught:
            run(adapter.retrieve(unknown))
        assert caught.value.status == 404 and caught.value.code == "response_not_found"
        error = refused(adapter, {"input": "y", "previous_response_id": unknown}, 404)
        assert (error.code, error.param) == ("previous_response_not_found", "previous_response_id")


def test_a_stream_is_stored_at_its_end_and_a_failed_one_not(adapter: OpenAIResponsesAdapter) -> None:
    t = translate(adapter, {"input": "x", "stream": True})
    _, final = stream_events(adapter, t, chunks_of(chat_reply("Hi")))
    run(adapter.finish(t, final))
    assert run(adapter.retrieve(t.response_id)) == final
    failed = translate(adapter, {"input": "x", "stream": True})
    stream = adapter.stream(failed)
    failed_event = events_of(stream.error({"error": {"message": "boom"}}))[-1]
    run(adapter.finish(failed, failed_event["response"]))
    with pytest.raises(APIError):
        run(adapter.retrieve(failed.response_id))


def test_a_stored_response_is_its_callers_and_deleting_it_forgets_it(adapter: OpenAIResponsesAdapter) -> None:
    """`caller` (the router's key identity) owns what it stores: another caller's GET, DELETE
    and previous_response_id see a 404, as for an id never stored."""
    t = run(adapter.to_chat({"input": "x"}, {}, "alice"))
    answer = run(adapter.reply(chat_reply("ok"), t))
    assert run(adapter.retrieve(t.response_id, "alice")) == answer
    for caller in ("bob", ""):
        with pytest.raises(APIError) as caught:
            run(adapter.retrieve(t.response_id, caller))
        assert caught.value.status == 404
        with pytest.raises(APIError) as caught:
            run(adapter.delete(t.response_id, caller))
        assert caught.value.status == 404
        with pytest.raises(APIError) as caught:
            run(adapter.to_chat({"input": "y", "previous_response_id": t.response_id}, {}, caller))
        assert caught.value.code == "previous_response_not_found"
    assert run(adapter.delete(t.response_id, "alice")) == {"id": t.response_id, "object": "response",
                                                            "deleted": True}
    with pytest.raises(APIError) as caught:
        run(adapter.retrieve(t.response_id, "alice"))
    assert caught.value.status == 404
    with pytest.raises(APIError) as caught:
        run(adapter.delete(t.response_id, "alice"))  # twice: the second finds nothing
    assert caught.value.code == "response_not_found"


class BrokenStore(MemoryResponseStore):
    async def put(self, entry: StoredResponse) -> None:
        raise ResponseStoreError("down")

    async def get(self, response_id: str) -> StoredResponse | None:
        raise ResponseStoreError("down")


def test_an_unreachable_store_is_503_on_lookups_and_costs_no_answer() -> None:
    adapter = OpenAIResponsesAdapter(BrokenStore())
    t = translate(adapter, {"input": "x"})
    assert run(adapter.reply(chat_reply("ok"), t))["status"] == "completed"
    error = refused(adapter, {"input": "x", "previous_response_id": "resp_1"}, 503)
    assert error.code == "response_store_unavailable"


def test_a_garbled_stored_conversation_is_read_as_far_as_it_makes_sense() -> None:
    """A store written by something else (a shared Redis) cannot make a continuation fail: what
    is not an item this adapter wrote is skipped."""
    store = MemoryResponseStore()
    garbled = [5, {"type": "message", "role": "robot", "content": "x"}, {"type": "message", "role": "user",
               "content": [{"type": "output_text", "text": "kept"}, 7]}, {"type": "function_call", "name": 3},
               {"type": "function_call_output", "call_id": "c", "output": None}, {"type": "mystery"}]
    run(store.put(StoredResponse({"id": "resp_g"}, garbled)))
    t = translate(OpenAIResponsesAdapter(store), {"previous_response_id": "resp_g", "input": "next"})
    assert t.chat["messages"] == [{"role": "user", "content": "kept"}, {"role": "tool", "tool_call_id": "c", "content": ""},
                                  {"role": "user", "content": "next"}]
