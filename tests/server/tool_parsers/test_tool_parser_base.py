"""Shared pieces: ids, OpenAI dict shapes, and reassembling a stream."""

from __future__ import annotations

import re

from tandem.server.tool_parsers import (
    ParsedMessage,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    new_call_id,
)
from tandem.server.tool_parsers.base import call_from_json, history_call, partial_suffix


def test_call_ids_are_openai_shaped_and_unique() -> None:
    ids = {new_call_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_openai_shapes() -> None:
    call = ToolCall(id="call_x", name="f", arguments='{"a": 1}')
    assert call.to_openai() == {
        "id": "call_x",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": 1}'},
    }
    first = ToolCallDelta(index=0, id="call_x", name="f", arguments="{")
    assert first.to_openai() == {
        "index": 0,
        "id": "call_x",
        "type": "function",
        "function": {"name": "f", "arguments": "{"},
    }
    assert ToolCallDelta(index=0, arguments="}").to_openai() == {
        "index": 0,
        "function": {"arguments": "}"},
    }


def test_from_deltas_joins_pieces_per_call() -> None:
    deltas = [
        StreamDelta(content="Hi"),
        StreamDelta(tool_calls=[ToolCallDelta(0, "call_a", "f", '{"a"')]),
        StreamDelta(tool_calls=[ToolCallDelta(1, "call_b", "g", "{}")]),
        StreamDelta(content="!", tool_calls=[ToolCallDelta(0, arguments=": 1}")]),
    ]
    msg = ParsedMessage.from_deltas(deltas)
    assert msg.content == "Hi!"
    assert msg.tool_calls == [
        ToolCall("call_a", "f", '{"a": 1}'),
        ToolCall("call_b", "g", "{}"),
    ]
    assert ParsedMessage.from_deltas([StreamDelta(content=" \n")]).content is None


def test_empty_delta_is_falsy() -> None:
    assert not StreamDelta()
    assert StreamDelta(content="x")
    assert StreamDelta(tool_calls=[ToolCallDelta(0)])


def test_call_from_json_rejects_what_cannot_be_executed() -> None:
    keys = ("arguments",)
    assert call_from_json([1], keys) is None
    assert call_from_json({"name": 3}, keys) is None
    assert call_from_json({"name": "f", "arguments": 3}, keys) is None
    assert call_from_json({"name": "f", "arguments": "[1]"}, keys) is None
    ok = call_from_json({"name": "f", "arguments": ""}, keys)
    assert ok is not None and ok.arguments == "{}"


def test_history_call_accepts_objects_and_dicts() -> None:
    assert history_call(ToolCall("c", "f", '{"a": 1}')) == ("f", {"a": 1})
    assert history_call({"function": {"name": "f", "arguments": {"a": 1}}}) == ("f", {"a": 1})
    assert history_call({"name": "f", "arguments": "{bad"}) == ("f", "{bad")


def test_partial_suffix() -> None:
    assert partial_suffix("abc <tool", "<tool_call>") == 5
    assert partial_suffix("abc <", "<tool_call>") == 1
    assert partial_suffix("abc", "<tool_call>") == 0
    assert partial_suffix("<tool_call>", "<tool_call>") == 0  # a whole marker is not partial
