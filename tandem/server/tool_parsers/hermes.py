"""Hermes / Qwen2.5 tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

This is also the format tandem teaches models whose chat template has no tool support: the
markers are unambiguous in prose, and Qwen-family models already know them.

Content is the text outside valid calls, less the whitespace that only separates text from
calls: a model writes "Let me check.\\n\\n<tool_call>..." and the client should not get the
newlines. Whitespace just before a call is dropped, and so is whitespace after a call when no
text precedes it; text on both sides of a call stays separated by what followed the call.

The streaming parser is the only implementation: `parse` runs it over the whole text, so both
modes agree by construction, and every rule only looks at text already seen, so the way the
text is split into deltas cannot change the result.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.server.tool_parsers.base import (
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamParser,
    call_from_json,
    history_call,
    partial_suffix,
)

logger = logging.getLogger(__name__)

START = "<tool_call>"
END = "</tool_call>"
_ARGS_KEYS = ("arguments", "parameters")


class HermesToolParser(ToolParser):
    """Qwen2.5 / Qwen3 / Hermes-2-Pro tool calls, possibly several in a row."""

    name = "hermes"
    start_marker = START
    end_marker = END

    def stream(self, prefix: str = "") -> HermesStreamParser:
        parser = HermesStreamParser()
        if prefix:
            parser.feed(prefix)
        return parser

    def forced_prefix(self, name: str | None) -> str:
        # A bare "<tool_call>\n" ends on a token boundary (Qwen has <tool_call> as one
        # token); naming the function also fixes the key the arguments go under.
        if name is None:
            return f"{START}\n"
        return f'{START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '

    def stop_strings(self, parallel_tool_calls: bool = True) -> list[str]:
        return [] if parallel_tool_calls else [END]

    def system_prompt(self, tools: Sequence[Mapping[str, Any]], system: str | None = None) -> str:
        # Qwen2.5's template text, so Qwen models see exactly what they were trained on.
        lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        text = (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>"
        )
        return f"{system}\n\n{text}" if system else text

    def render_tool_calls(self, calls: Sequence[ToolCall | Mapping[str, Any]]) -> str:
        blocks = []
        for call in calls:
            name, args = history_call(call)
            body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
            blocks.append(f"{START}\n{body}\n{END}")
        return "\n".join(blocks)

    def render_tool_result(self, content: str, name: str | None = None) -> str:
        # Qwen's template ignores the name too: results follow the calls' order.
        del name
        return f"<tool_response>\n{content}\n</tool_response>"


def _decode_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    return call_from_json(obj, _ARGS_KEYS)


class HermesStreamParser(ToolStreamParser):
    """Text streams at once except for a possible marker start and trailing whitespace;
    a call is emitted whole when its `</tool_call>` arrives (or at `finish`)."""

    def __init__(self) -> None:
        self._buf = ""  # text not yet decided: a partial START, or a call's body so far
        self._in_call = False
        self._scan_from = 0  # where to resume looking for END inside the body
        self._pending_ws = ""  # whitespace after text: dropped if a valid call follows
        self._after_call = False  # calls but no text yet: drop whitespace until text comes
        self._emitted_text = False
        self._num_calls = 0

    @property
    def called_tools(self) -> bool:
        return self._num_calls > 0

    def feed(self, text_delta: str) -> StreamDelta:
        out = StreamDelta()
        self._buf += text_delta
        while True:
            if self._in_call:
                end = self._buf.find(END, self._scan_from)
                if end < 0:
                    self._scan_from = max(0, len(self._buf) - len(END) + 1)
                    break
                body = self._buf[:end]
                self._buf = self._buf[end + len(END) :]
                self._in_call = False
                self._close_call(body, START + body + END, out)
            else:
                start = self._buf.find(START)
                if start < 0:
                    keep = partial_suffix(self._buf, START)
                    self._text(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                self._text(self._buf[:start], out)
                self._buf = self._buf[start + len(START) :]
                self._in_call = True
                self._scan_from = 0
        return out

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self._in_call:
            # Models often stop before "</tool_call>" (or the server stopped on it): the
            # call counts if its JSON is complete, a cut-off closing tag included.
            body = self._buf
            complete = body[: len(body) - partial_suffix(body, END)]
            self._close_call(complete, START + body, out)
        else:
            self._text(self._buf, out)
        self._buf = ""
        self._in_call = False
        if self._emitted_text and self._pending_ws:
            out.content += self._pending_ws
        self._pending_ws = ""
        return out

    def _text(self, text: str, out: StreamDelta) -> None:
        """Emit text outside calls, holding trailing whitespace until we know whether a call
        (which swallows it) or more text (which keeps it) comes next."""
        if not text:
            return
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            out.content += self._pending_ws + body
            self._pending_ws = text[len(body) :]
            self._emitted_text = True
        else:
            self._pending_ws += text

    def _close_call(self, body: str, raw: str, out: StreamDelta) -> None:
        call = _decode_call(body)
        if call is None:
            logger.debug("tool call is not valid JSON with a name; returned as text: %r", raw)
            self._text(raw, out)
            return
        self._pending_ws = ""
        # Text after the call keeps its leading whitespace only if it continues earlier text.
        self._after_call = not self._emitted_text
        out.tool_calls.append(
            ToolCallDelta(
                index=self._num_calls, id=call.id, name=call.name, arguments=call.arguments
            )
        )
        self._num_calls += 1
