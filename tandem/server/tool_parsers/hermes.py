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

Bare calls. Small Qwen models (Qwen2.5-Coder-0.5B under OpenCode's prompt, for one) often
answer with the call's JSON object and no tags, sometimes in a ```json fence. llama.cpp's
Hermes parser accepts that; so does this one, but only where it cannot be mistaken for an
answer: the whole response must be such objects, each naming a function the request
declared. A response that starts like one (`{`, or a ```json fence) is therefore held
until it ends, and streamed as text if it turns out not to be calls.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from tandem.server.tool_parsers.base import (
    CallShape,
    ContentSpacing,
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
FENCE = "```"
_ARGS_KEYS = ("arguments", "parameters")
_DECODER = json.JSONDecoder()


class HermesToolParser(ToolParser):
    """Qwen2.5 / Qwen3 / Hermes-2-Pro tool calls, possibly several in a row."""

    name = "hermes"
    start_marker = START
    end_marker = END

    def stream(self, prefix: str = "", tool_names: Collection[str] = ()) -> HermesStreamParser:
        parser = HermesStreamParser(tool_names)
        if prefix:
            parser.feed(prefix)
        return parser

    def call_shape(self) -> CallShape:
        # As render_tool_calls writes them: the JSON object's envelope is fixed text, so the
        # grammar forces it and the name picks the arguments' schema.
        return CallShape(f"{START}\n", f"\n{END}\n{START}\n", f"\n{END}",
                         lambda name: f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ',
                         lambda name: "}", bare=True)

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


class _Bare(enum.Enum):
    UNDECIDED = "undecided"  # blank, or a fence whose language is not yet known
    CANDIDATE = "candidate"  # starts like a bare call: held to the end
    OFF = "off"  # plain Hermes parsing from here on


def _classify_bare(text: str) -> _Bare:
    """Whether a response starting with `text` may be bare calls; once CANDIDATE or OFF, any
    longer text is classified the same."""
    head = text.lstrip()
    if not head:
        return _Bare.UNDECIDED
    if head.startswith("{"):
        return _Bare.CANDIDATE
    if head.startswith(FENCE):
        tag, newline, rest = head[len(FENCE) :].partition("\n")
        if not newline:
            return _Bare.UNDECIDED if "json".startswith(tag.strip()) else _Bare.OFF
        if tag.strip() not in ("", "json"):
            return _Bare.OFF
        rest = rest.lstrip()
        if not rest:
            return _Bare.UNDECIDED
        return _Bare.CANDIDATE if rest.startswith("{") else _Bare.OFF
    return _Bare.UNDECIDED if FENCE.startswith(head) else _Bare.OFF


def _bare_calls(text: str, tool_names: Collection[str]) -> list[ToolCall]:
    """The calls a whole response is made of, or [] unless every object names a declared
    function and nothing but whitespace (and one code fence) surrounds them."""
    body = text.strip()
    if body.startswith(FENCE):
        body = body[len(FENCE) :].partition("\n")[2].rstrip()
        if body.endswith(FENCE):  # a model may stop before closing its fence
            body = body[: -len(FENCE)]
    calls: list[ToolCall] = []
    pos = 0
    while True:
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if pos == len(body):
            return calls
        try:
            obj, pos = _DECODER.raw_decode(body, pos)
        except json.JSONDecodeError:
            return []
        call = call_from_json(obj, _ARGS_KEYS)
        if call is None or call.name not in tool_names:
            return []
        calls.append(call)


class HermesStreamParser(ToolStreamParser):
    """Text streams at once except for a possible marker start and trailing whitespace;
    a call is emitted whole when its `</tool_call>` arrives (or at `finish`). With declared
    `tool_names`, a response that starts like a bare call is held to the end first."""

    def __init__(self, tool_names: Collection[str] = ()) -> None:
        self._tool_names = frozenset(tool_names)
        self._bare = _Bare.UNDECIDED if self._tool_names else _Bare.OFF
        self._held = ""  # the response so far, while it may still be bare calls
        self._buf = ""  # text not yet decided: a partial START, or a call's body so far
        self._in_call = False
        self._scan_from = 0  # where to resume looking for END inside the body
        self._spacing = ContentSpacing()
        self._num_calls = 0

    @property
    def called_tools(self) -> bool:
        return self._num_calls > 0

    def feed(self, text_delta: str) -> StreamDelta:
        if self._bare is _Bare.OFF:
            return self._feed_tagged(text_delta)
        self._held += text_delta
        self._bare = _classify_bare(self._held)
        if self._bare is not _Bare.OFF:
            return StreamDelta()
        held, self._held = self._held, ""
        return self._feed_tagged(held)

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self._bare is not _Bare.OFF:
            held, self._held = self._held, ""
            self._bare = _Bare.OFF
            calls = _bare_calls(held, self._tool_names)
            if calls:
                for call in calls:
                    out.tool_calls.append(ToolCallDelta(
                        index=self._num_calls, id=call.id, name=call.name, arguments=call.arguments))
                    self._num_calls += 1
                return out
            out.extend(self._feed_tagged(held))
        out.extend(self._finish_tagged())
        return out

    def _feed_tagged(self, text_delta: str) -> StreamDelta:
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

    def _finish_tagged(self) -> StreamDelta:
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
        self._spacing.flush(out)
        return out

    def _text(self, text: str, out: StreamDelta) -> None:
        """Text outside calls (see ContentSpacing for its whitespace)."""
        self._spacing.text(text, out)

    def _close_call(self, body: str, raw: str, out: StreamDelta) -> None:
        call = _decode_call(body)
        if call is None:
            logger.debug("tool call is not valid JSON with a name; returned as text: %r", raw)
            self._text(raw, out)
            return
        self._spacing.call_emitted()
        out.tool_calls.append(
            ToolCallDelta(
                index=self._num_calls, id=call.id, name=call.name, arguments=call.arguments
            )
        )
        self._num_calls += 1
