"""An Anthropic Messages event stream read strictly, and accumulated into its Message.

`accumulate` checks what a client relies on while it builds the message: each event is
`event: <type>` + `data: {...}` with the same type, the stream opens with `message_start`
and `ping` and ends with `message_delta` and `message_stop` (or one `error`, last), blocks
come one at a time with consecutive indexes, every delta goes to the open block and matches
its type, and a tool call's `partial_json` pieces join to a JSON object.
"""

from __future__ import annotations

import copy
import json
from typing import Any

_DELTA_OF_BLOCK = {"text": "text_delta", "thinking": "thinking_delta", "tool_use": "input_json_delta"}


def parse_events(events: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(type, payload) of each SSE event string (one event per string, as the adapter writes)."""
    parsed = []
    for event in events:
        assert event.endswith("\n\n"), event
        lines = event[:-2].split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), event
        name, payload = lines[0][7:], json.loads(lines[1][6:])
        assert payload["type"] == name, event
        parsed.append((name, payload))
    return parsed


def split_sse(body: str) -> list[str]:
    """A whole SSE body as one string per event."""
    return [part + "\n\n" for part in body.split("\n\n") if part.strip()]


def accumulate(events: list[str]) -> dict[str, Any]:
    """The Message the events build; an `error` event (last) gives `{"error": ...}` instead."""
    parsed = parse_events(events)
    names = [name for name, _ in parsed]
    if "error" in names:
        assert names.index("error") == len(names) - 1, names  # nothing after an error
        return {"error": parsed[-1][1]["error"], "events": names}
    assert names[:2] == ["message_start", "ping"], names
    assert names[-2:] == ["message_delta", "message_stop"], names
    message = copy.deepcopy(parsed[0][1]["message"])
    assert message["content"] == [] and message["stop_reason"] is None
    open_index: int | None = None
    json_text: dict[int, str] = {}
    for name, payload in parsed[2:-2]:
        if name == "content_block_start":
            assert open_index is None, "a block started while another was open"
            assert payload["index"] == len(message["content"]), payload
            block = copy.deepcopy(payload["content_block"])
            message["content"].append(block)
            open_index = payload["index"]
            if block["type"] == "tool_use":
                assert block["input"] == {} and block["id"] and block["name"]
                json_text[open_index] = ""
        elif name == "content_block_delta":
            assert payload["index"] == open_index, f"a delta for block {payload['index']}, open: {open_index}"
            block, delta = message["content"][open_index], payload["delta"]
            assert delta["type"] == _DELTA_OF_BLOCK[block["type"]], (block, delta)
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                json_text[open_index] += delta["partial_json"]
        elif name == "content_block_stop":
            assert payload["index"] == open_index, payload
            if open_index in json_text:
                text = json_text[open_index]
                message["content"][open_index]["input"] = json.loads(text) if text else {}
            open_index = None
        else:
            assert name == "ping", name
    assert open_index is None, "the stream ended with a block open"
    end = parsed[-2][1]
    message["stop_reason"] = end["delta"]["stop_reason"]
    message["stop_sequence"] = end["delta"]["stop_sequence"]
    message["usage"] = {**message["usage"], **end["usage"]}
    return message
