"""Llama 3.1 / 3.2 JSON tool calls: `{"name": "fn", "parameters": {...}}`, several joined by "; ".

There is no marker around a call: the whole response is either calls (it starts with "{",
maybe after `<|python_tag|>`) or text. So a stream is decided on its first non-space
character: text streams from then on; a would-be call is held to the end and parsed whole.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from tandem.server.tool_parsers.base import (
    CallShape,
    ParsedMessage,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamParser,
    call_from_json,
    history_call,
)

logger = logging.getLogger(__name__)

PYTHON_TAG = "<|python_tag|>"
_ARGS_KEYS = ("parameters", "arguments")
_DECODER = json.JSONDecoder()


class _Kind(enum.Enum):
    UNDECIDED = "undecided"  # only whitespace and (part of) <|python_tag|> so far
    TEXT = "text"
    CALLS = "calls"


def _classify(text: str) -> _Kind:
    """What a response starting with `text` is; once decided, longer text decides the same."""
    head = text.lstrip()
    if head.startswith(PYTHON_TAG):
        head = head[len(PYTHON_TAG) :].lstrip()
    elif PYTHON_TAG.startswith(head):
        return _Kind.UNDECIDED
    if not head:
        return _Kind.UNDECIDED
    return _Kind.CALLS if head.startswith("{") else _Kind.TEXT


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 custom-tool calls (JSON, not the built-in `<|python_tag|>` tools)."""

    name = "llama3_json"

    def stream(self, prefix: str = "", tool_names: Collection[str] = ()) -> Llama3JsonStreamParser:
        del tool_names  # bare JSON is this format already
        parser = Llama3JsonStreamParser(self)
        if prefix:
            parser.feed(prefix)
        return parser

    def parse(self, text: str, tool_names: Collection[str] = ()) -> ParsedMessage:
        """Calls, then whatever follows the last valid one as content.

        A response that is not call-shaped is all content; so is one whose first object is
        not a valid call. After valid calls, anything that does not parse as a further call
        (prose, a broken object) is returned as content rather than lost.
        """
        del tool_names
        if _classify(text) is not _Kind.CALLS:
            return ParsedMessage(content=text if text.strip() else None, tool_calls=[])
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :]
        calls: list[ToolCall] = []
        end = 0
        while True:
            pos = _skip_ws(body, end)
            if calls and body.startswith(";", pos):
                pos = _skip_ws(body, pos + 1)
            try:
                obj, after = _DECODER.raw_decode(body, pos)
            except json.JSONDecodeError:
                break
            call = call_from_json(obj, _ARGS_KEYS)
            if call is None:
                break
            calls.append(call)
            end = after
        if not calls:
            logger.debug("JSON-shaped response is not a tool call; returned as text")
            return ParsedMessage(content=text if text.strip() else None, tool_calls=[])
        rest = body[end:].strip()
        if rest.startswith(";"):
            rest = rest[1:].strip()
        return ParsedMessage(content=rest or None, tool_calls=calls)

    def call_shape(self) -> CallShape:
        return CallShape("", "; ", "",
                         lambda name: f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": ',
                         lambda name: "}")

    def forced_prefix(self, name: str | None) -> str:
        if name is None:
            return '{"name": "'
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": '

    def system_prompt(self, tools: Sequence[Mapping[str, Any]], system: str | None = None) -> str:
        # Llama 3.1's template text (with the space its template forgets before "Do not").
        defs = "\n\n".join(json.dumps(tool, indent=4, ensure_ascii=False) for tool in tools)
        text = (
            "Given the following functions, please respond with a JSON for a function call "
            "with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables.\n\n"
            f"{defs}"
        )
        return f"{system}\n\n{text}" if system else text

    def render_tool_calls(self, calls: Sequence[ToolCall | Mapping[str, Any]]) -> str:
        parts = []
        for call in calls:
            name, args = history_call(call)
            parts.append(json.dumps({"name": name, "parameters": args}, ensure_ascii=False))
        return "; ".join(parts)

    def render_tool_result(self, content: str, name: str | None = None) -> str:
        # Llama's own templates pass the result through unchanged (as an "ipython" turn).
        del name
        return content


class Llama3JsonStreamParser(ToolStreamParser):
    """Holds the response until its first non-space character decides text or calls."""

    def __init__(self, parser: Llama3JsonToolParser) -> None:
        self._parser = parser
        self._buf = ""
        self._kind = _Kind.UNDECIDED
        self._num_calls = 0

    @property
    def called_tools(self) -> bool:
        return self._num_calls > 0

    def feed(self, text_delta: str) -> StreamDelta:
        if self._kind is _Kind.TEXT:
            return StreamDelta(content=text_delta)
        self._buf += text_delta
        if self._kind is _Kind.UNDECIDED:
            self._kind = _classify(self._buf)
            if self._kind is _Kind.TEXT:
                text, self._buf = self._buf, ""
                return StreamDelta(content=text)
        return StreamDelta()

    def finish(self) -> StreamDelta:
        text, self._buf = self._buf, ""
        if self._kind is _Kind.TEXT:
            return StreamDelta()
        # Undecided text (blank, or a lone tag) and would-be calls: parse() decides both.
        parsed = self._parser.parse(text)
        out = StreamDelta(content=parsed.content or "")
        for call in parsed.tool_calls:
            out.tool_calls.append(
                ToolCallDelta(
                    index=self._num_calls, id=call.id, name=call.name, arguments=call.arguments
                )
            )
            self._num_calls += 1
        return out
