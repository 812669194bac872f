"""Is a recorded event stream well-formed? (`tests.support.protocol_streams`)

The checks a client's stream parser relies on, for Anthropic Messages and OpenAI Responses
streams as tandem sends them to Claude Code and Codex. Each takes the stream's events
(`SSEFrame`s from tests/support/recording_proxy.py), raises `AssertionError` naming the event
sequence when something is off, and returns what a test reads next (the usage, the blocks or
the final response). No network, no model: tests/support/test_protocol_streams.py checks them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tests.support.recording_proxy import SSEFrame

_DELTA_FOR_BLOCK = {
    "text": {"text_delta", "citations_delta"},
    "tool_use": {"input_json_delta"},
    "server_tool_use": {"input_json_delta"},
    "thinking": {"thinking_delta", "signature_delta"},
    "redacted_thinking": set(),
}


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise AssertionError(f"{what} is not JSON: {text[:200]!r}") from error
    assert isinstance(value, dict), f"{what} is not a JSON object: {text[:200]!r}"
    return value


def _names(frames: list[SSEFrame]) -> str:
    return " ".join(str(f.event) for f in frames)


def _payloads(frames: list[SSEFrame]) -> list[dict[str, Any]]:
    """Each frame's JSON, checked to be an object whose `type` is the frame's event name."""
    payloads = []
    for frame in frames:
        payload = _json_object(frame.data, f"event {frame.event!r}'s data")
        assert payload.get("type") == frame.event, (
            f"event name {frame.event!r} but data type {payload.get('type')!r}: {_names(frames)}")
        payloads.append(payload)
    return payloads


@dataclass
class AnthropicMessage:
    """What a well-formed Messages stream said."""

    usage: dict[str, Any]  # message_start's usage, updated by message_delta's
    stop_reason: str
    blocks: list[dict[str, Any]] = field(default_factory=list)  # reassembled content blocks

    @property
    def prompt_tokens(self) -> int:
        """Every prompt token, however it was billed: input + cache read + cache write."""
        return (self.usage.get("input_tokens", 0) + (self.usage.get("cache_read_input_tokens") or 0)
                + (self.usage.get("cache_creation_input_tokens") or 0))

    @property
    def cached_fraction(self) -> float:
        return (self.usage.get("cache_read_input_tokens") or 0) / max(self.prompt_tokens, 1)


def check_anthropic_stream(frames: list[SSEFrame]) -> AnthropicMessage:
    """message_start, then whole content blocks in index order (start, deltas of the block's
    kind, stop), then message_delta with a stop_reason, then message_stop, last; `ping`
    anywhere; no `error` event."""
    names = _names(frames)
    payloads = [p for p in _payloads(frames) if p["type"] != "ping"]
    errors = [p for p in payloads if p["type"] == "error"]
    assert not errors, f"error event in the stream: {errors[0]} ({names})"
    assert payloads and payloads[0]["type"] == "message_start", f"does not open with message_start: {names}"
    message = payloads[0]["message"]
    assert message.get("role") == "assistant" and message.get("type") == "message", message
    assert isinstance(message.get("id"), str) and message["id"], f"message_start without an id: {message}"
    usage = dict(message.get("usage") or {})
    assert isinstance(usage.get("input_tokens"), int), f"message_start without usage.input_tokens: {message}"
    assert len(payloads) >= 3, f"too short: {names}"
    assert payloads[-1]["type"] == "message_stop", f"does not end with message_stop: {names}"
    assert payloads[-2]["type"] == "message_delta", f"message_stop not right after message_delta: {names}"
    final = payloads[-2]
    stop_reason = final["delta"].get("stop_reason")
    assert stop_reason in {"end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal"}, final
    usage.update({k: v for k, v in (final.get("usage") or {}).items() if v is not None})
    assert isinstance(usage.get("output_tokens"), int), f"no output_tokens in the usage: {usage}"

    blocks: list[dict[str, Any]] = []
    open_block: dict[str, Any] | None = None
    partial_json = ""
    for event in payloads[1:-2]:
        kind = event["type"]
        if kind == "content_block_start":
            assert open_block is None, f"block {event['index']} starts inside another: {names}"
            assert event["index"] == len(blocks), f"block index {event['index']}, expected {len(blocks)}: {names}"
            open_block = dict(event["content_block"])
            assert open_block.get("type") in _DELTA_FOR_BLOCK, f"unknown block type: {open_block}"
            partial_json = ""
        elif kind == "content_block_delta":
            assert open_block is not None and event["index"] == len(blocks), f"delta outside its block: {names}"
            delta = event["delta"]
            assert delta["type"] in _DELTA_FOR_BLOCK[open_block["type"]], (open_block["type"], delta)
            if delta["type"] == "text_delta":
                open_block["text"] = open_block.get("text", "") + delta["text"]
            elif delta["type"] == "input_json_delta":
                partial_json += delta["partial_json"]
            elif delta["type"] == "thinking_delta":
                open_block["thinking"] = open_block.get("thinking", "") + delta["thinking"]
        elif kind == "content_block_stop":
            assert open_block is not None and event["index"] == len(blocks), f"stop outside its block: {names}"
            if open_block["type"] in ("tool_use", "server_tool_use"):
                assert isinstance(open_block.get("id"), str) and open_block.get("name"), open_block
                open_block["input"] = (_json_object(partial_json, "the tool input") if partial_json
                                       else open_block.get("input", {}))
            blocks.append(open_block)
            open_block = None
        else:
            raise AssertionError(f"unexpected {kind!r} between message_start and message_delta: {names}")
    assert open_block is None, f"block {len(blocks)} never stopped: {names}"
    if stop_reason == "tool_use":
        assert any(b["type"] == "tool_use" for b in blocks), f"stop_reason tool_use without a tool_use block: {blocks}"
    return AnthropicMessage(usage, stop_reason, blocks)


def check_anthropic_message(body: dict[str, Any]) -> AnthropicMessage:
    """A whole (non-streamed) Messages response."""
    assert body.get("type") == "message" and body.get("role") == "assistant", body
    assert isinstance(body.get("content"), list), body
    assert isinstance((body.get("usage") or {}).get("input_tokens"), int), body
    return AnthropicMessage(dict(body["usage"]), body.get("stop_reason"), list(body["content"]))


_TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


@dataclass
class ResponsesResult:
    """What a well-formed Responses stream said."""

    response: dict[str, Any]  # the terminal event's response
    items: list[dict[str, Any]]  # the output items, as their output_item.done events gave them

    @property
    def usage(self) -> dict[str, Any]:
        return self.response.get("usage") or {}

    @property
    def cached_fraction(self) -> float:
        cached = (self.usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
        return cached / max(self.usage.get("input_tokens", 0), 1)


def check_responses_stream(frames: list[SSEFrame]) -> ResponsesResult:
    """response.created first, then response.in_progress, the output items each added then done
    (index order, their deltas in between), and response.completed last, whose output is the
    items done; every event's sequence_number one more than the one before; no `error` or
    `response.failed` event. (response.incomplete, a length stop, counts as well-formed.)"""
    names = _names(frames)
    payloads = _payloads(frames)
    assert payloads, "an empty stream"
    errors = [p for p in payloads if p["type"] in ("error", "response.failed")]
    assert not errors, f"error event in the stream: {errors[0]} ({names})"
    numbers = [p.get("sequence_number") for p in payloads]
    assert all(isinstance(n, int) for n in numbers), f"events without a sequence_number: {names}"
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), f"sequence numbers {numbers}"
    assert payloads[0]["type"] == "response.created", f"does not open with response.created: {names}"
    assert payloads[-1]["type"] in _TERMINAL, f"does not end with response.completed: {names}"
    assert sum(p["type"] in _TERMINAL for p in payloads) == 1, f"more than one terminal event: {names}"
    created = payloads[0]["response"]
    assert created.get("object") == "response" and isinstance(created.get("id"), str), created

    done: dict[int, dict[str, Any]] = {}
    open_items: dict[int, dict[str, Any]] = {}
    for event in payloads[1:-1]:
        kind = event["type"]
        if kind == "response.in_progress":
            assert event["response"]["id"] == created["id"], event
        elif kind == "response.output_item.added":
            index = event["output_index"]
            assert index == len(done) + len(open_items) and not open_items, f"item {index} added out of order: {names}"
            open_items[index] = event["item"]
        elif kind == "response.output_item.done":
            index = event["output_index"]
            assert index in open_items, f"item {index} done but never added: {names}"
            added = open_items.pop(index)
            item = event["item"]
            assert item.get("type") == added.get("type") and item.get("id") == added.get("id"), (added, item)
            if item["type"] == "function_call":
                assert item.get("call_id") and item.get("name"), item
                _json_object(item["arguments"], f"function call {item['name']}'s arguments")
            done[index] = item
        else:
            index = event.get("output_index")
            assert index in open_items, f"{kind} for item {index}, which is not open: {names}"
            item_id = event.get("item_id")
            assert item_id is None or item_id == open_items[index].get("id"), (event, open_items[index])
    assert not open_items, f"items added but never done: {sorted(open_items)} ({names})"
    final = payloads[-1]["response"]
    assert final["id"] == created["id"], (created["id"], final["id"])
    items = [done[i] for i in sorted(done)]
    assert [o.get("id") for o in final.get("output", [])] == [i.get("id") for i in items], (
        "the terminal response's output is not the items streamed", final.get("output"), items)
    usage = final.get("usage") or {}
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        assert isinstance(usage.get(key), int), f"usage without {key}: {usage}"
    assert isinstance((usage.get("input_tokens_details") or {}).get("cached_tokens"), int), usage
    return ResponsesResult(final, items)
