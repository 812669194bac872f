"""The stream checks the agent-harness tests apply: a well-formed Messages or Responses stream
passes and says what it carried; each way of breaking one fails."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.protocol_streams import check_anthropic_stream, check_responses_stream
from tests.support.recording_proxy import SSEFrame, parse_sse


def _frames(events: list[dict[str, Any]]) -> list[SSEFrame]:
    raw = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)
    return parse_sse(raw.encode())


def anthropic_events() -> list[dict[str, Any]]:
    """A text block then a tool call, as Claude Code sees a turn that calls Read."""
    return [
        {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 1, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": 0}}},
        {"type": "ping"},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Let me "}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "read it."}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "input_json_delta", "partial_json": '{"file_path": '}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "input_json_delta", "partial_json": '"/r/calc.py"}'}},
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"type": "message_delta", "stop_reason": "tool_use", "stop_sequence": None},
         "usage": {"input_tokens": 100, "cache_read_input_tokens": 900, "cache_creation_input_tokens": 0,
                   "output_tokens": 12}},
        {"type": "message_stop"},
    ]


def test_a_well_formed_messages_stream_passes() -> None:
    message = check_anthropic_stream(_frames(anthropic_events()))
    assert message.stop_reason == "tool_use"
    assert message.blocks == [
        {"type": "text", "text": "Let me read it."},
        {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "/r/calc.py"}},
    ]
    assert message.usage["output_tokens"] == 12
    assert message.prompt_tokens == 1000 and message.cached_fraction == 0.9


def _drop(kind: str) -> Callable[[list[dict[str, Any]]], None]:
    def mutate(events: list[dict[str, Any]]) -> None:
        events[:] = [e for e in events if e["type"] != kind]
    return mutate


def _set(index: int, key: str, value: Any) -> Callable[[list[dict[str, Any]]], None]:
    def mutate(events: list[dict[str, Any]]) -> None:
        events[index][key] = value
    return mutate


BROKEN_MESSAGES: dict[str, Callable[[list[dict[str, Any]]], None]] = {
    "no message_stop": _drop("message_stop"),
    "no message_delta": _drop("message_delta"),
    "no message_start": lambda e: e.pop(0),
    "block never stopped": lambda e: e.pop(9),
    "blocks interleaved": lambda e: e.insert(5, e.pop(6)),
    "block index skipped": _set(6, "index", 2),
    "wrong delta kind": lambda e: e[3].update(delta={"type": "input_json_delta", "partial_json": "{}"}),
    "tool input not JSON": lambda e: e[8]["delta"].update(partial_json='"/r/calc.py"'),
    "no stop_reason": lambda e: e[-2]["delta"].update(stop_reason=None),
    "tool_use stop without a tool": lambda e: [e.pop(6) for _ in range(4)],
    "error event": lambda e: e.insert(3, {"type": "error", "error": {"type": "overloaded_error", "message": "x"}}),
    "event after message_stop": lambda e: e.append({"type": "content_block_stop", "index": 0}),
    "no input_tokens": lambda e: e[0]["message"].update(usage={}),
}


@pytest.mark.parametrize("breakage", sorted(BROKEN_MESSAGES))
def test_a_broken_messages_stream_fails(breakage: str) -> None:
    events = anthropic_events()
    BROKEN_MESSAGES[breakage](events)
    with pytest.raises(AssertionError):
        check_anthropic_stream(_frames(events))


def test_an_event_name_that_is_not_its_data_type_fails() -> None:
    frames = _frames(anthropic_events())
    frames[0] = SSEFrame("message", frames[0].data)
    with pytest.raises(AssertionError, match="event name"):
        check_anthropic_stream(frames)


def responses_events() -> list[dict[str, Any]]:
    """A function call then a message, as Codex sees a turn."""
    response = {"id": "resp_1", "object": "response", "status": "in_progress", "output": [], "usage": None}
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "exec_command",
            "arguments": '{"cmd": "cat calc.py"}', "status": "completed"}
    text = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "Done.", "annotations": []}]}
    events = [
        {"type": "response.created", "response": response},
        {"type": "response.in_progress", "response": response},
        {"type": "response.output_item.added", "output_index": 0, "item": {**call, "arguments": "", "status": "in_progress"}},
        {"type": "response.function_call_arguments.delta", "output_index": 0, "item_id": "fc_1", "delta": call["arguments"]},
        {"type": "response.function_call_arguments.done", "output_index": 0, "item_id": "fc_1", "arguments": call["arguments"]},
        {"type": "response.output_item.done", "output_index": 0, "item": call},
        {"type": "response.output_item.added", "output_index": 1, "item": {**text, "content": [], "status": "in_progress"}},
        {"type": "response.content_part.added", "output_index": 1, "item_id": "msg_1", "content_index": 0,
         "part": {"type": "output_text", "text": ""}},
        {"type": "response.output_text.delta", "output_index": 1, "item_id": "msg_1", "content_index": 0, "delta": "Done."},
        {"type": "response.output_text.done", "output_index": 1, "item_id": "msg_1", "content_index": 0, "text": "Done."},
        {"type": "response.content_part.done", "output_index": 1, "item_id": "msg_1", "content_index": 0,
         "part": text["content"][0]},
        {"type": "response.output_item.done", "output_index": 1, "item": text},
        {"type": "response.completed", "response": {
            **response, "status": "completed", "output": [call, text],
            "usage": {"input_tokens": 1000, "input_tokens_details": {"cached_tokens": 850},
                      "output_tokens": 20, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 1020}}},
    ]
    for number, event in enumerate(events):
        event["sequence_number"] = number
    return events


def test_a_well_formed_responses_stream_passes() -> None:
    result = check_responses_stream(_frames(responses_events()))
    assert [item["type"] for item in result.items] == ["function_call", "message"]
    assert result.response["status"] == "completed"
    assert result.cached_fraction == 0.85


BROKEN_RESPONSES: dict[str, Callable[[list[dict[str, Any]]], None]] = {
    "no response.completed": lambda e: e.pop(),
    "no response.created": lambda e: e.pop(0),
    "item never done": lambda e: e.pop(11),
    "item done never added": lambda e: e.pop(2),
    "items out of order": lambda e: e[6].update(output_index=2),
    "delta for a closed item": lambda e: e.insert(6, dict(e[3])),
    "delta naming another item": lambda e: e[8].update(item_id="msg_other"),
    "arguments not JSON": lambda e: e[5]["item"].update(arguments="cat"),
    "output differs from items": lambda e: e[-1]["response"].update(output=[]),
    "sequence gap": lambda e: e[4].update(sequence_number=40),
    "no sequence numbers": lambda e: [event.pop("sequence_number") for event in e],
    "error event": lambda e: e.insert(3, {"type": "error", "code": "x", "message": "boom"}),
    "failed": lambda e: e[-1].update(type="response.failed"),
    "no usage": lambda e: e[-1]["response"].update(usage=None),
    "no cached_tokens": lambda e: e[-1]["response"]["usage"].pop("input_tokens_details"),
    "two terminal events": lambda e: e.append(dict(e[-1])),
}


@pytest.mark.parametrize("breakage", sorted(BROKEN_RESPONSES))
def test_a_broken_responses_stream_fails(breakage: str) -> None:
    events = responses_events()
    BROKEN_RESPONSES[breakage](events)
    if breakage not in ("sequence gap", "no sequence numbers"):
        for number, event in enumerate(events):
            event["sequence_number"] = number
    with pytest.raises(AssertionError):
        check_responses_stream(_frames(events))
