"""Kimi-K2 tool calls: special-token sections with `functions.NAME:IDX` call ids.

The model writes its calls after any text, in one section:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

Each call is headed by its id, `functions.NAME:IDX`, IDX counting the calls of the whole
conversation. Moonshot's API returns that id as the call's `id`, and Kimi's chat template
writes earlier calls back with the ids the client sends, so the id goes out exactly as the
model wrote it (a bare `NAME:IDX` gets the `functions.` it lacks) and an earlier call whose id
is not in that form (`call_…`, from another model) is rendered as `functions.NAME:IDX` with
its position in the conversation.

The markers are special tokens of Kimi's vocabulary, which a detokenizer that skips special
tokens drops: `preserved_tokens` names them, and the server keeps their text (and only
theirs) in the output this parser reads.

As with Hermes, the streaming parser is the only implementation (`parse` runs it over the
whole text), and a call is emitted whole when its `<|tool_call_end|>` arrives; text that may
still become a marker is held back. A call whose header or arguments do not parse is
returned as text, markers included.
"""

from __future__ import annotations

import enum
import json
import logging
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from tandem.server.tool_parsers.base import (
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamParser,
    history_call,
    partial_suffix,
)

logger = logging.getLogger(__name__)

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

# `functions.NAME:IDX` (the prefix may be missing); NAME as OpenAI allows, plus dots.
_HEADER = re.compile(r"\s*(?:functions\.)?([A-Za-z0-9_.\-]{1,128}):(\d{1,9})\s*")
_KIMI_ID = re.compile(r"functions\.[A-Za-z0-9_.\-]{1,128}:\d{1,9}")


def kimi_call_id(name: str, index: int) -> str:
    return f"functions.{name}:{index}"


def _decode_call(body: str) -> ToolCall | None:
    """`functions.NAME:IDX<|tool_call_argument_begin|>{...}` as a call, or None."""
    header, sep, arguments = body.partition(ARGUMENT_BEGIN)
    match = _HEADER.fullmatch(header)
    if not sep or match is None:
        return None
    arguments = arguments.strip()
    try:
        args = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return None
    if not isinstance(args, dict):
        return None
    name, index = match.group(1), int(match.group(2))
    return ToolCall(id=kimi_call_id(name, index), name=name, arguments=json.dumps(args, ensure_ascii=False))


class KimiK2ToolParser(ToolParser):
    """Kimi-K2 (Instruct, Thinking, K2.5) tool-call sections."""

    name = "kimi_k2"
    preserved_tokens = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)

    def stream(self, prefix: str = "", tool_names: Collection[str] = ()) -> KimiK2StreamParser:
        del tool_names  # the format is unambiguous: no declared name is needed to accept a call
        parser = KimiK2StreamParser()
        if prefix:
            parser.feed(prefix)
        return parser

    def forced_prefix(self, name: str | None) -> str:
        # The index of a forced call is not known here (it counts the conversation's calls);
        # the model writes the header itself unless a name is forced, where 0 is as good as
        # any: the id only has to be unique within the response.
        if name is None:
            return f"{SECTION_BEGIN}{CALL_BEGIN}"
        return f"{SECTION_BEGIN}{CALL_BEGIN}{kimi_call_id(name, 0)}{ARGUMENT_BEGIN}"

    def stop_strings(self, parallel_tool_calls: bool = True) -> list[str]:
        return [] if parallel_tool_calls else [CALL_END]

    def system_prompt(self, tools: Sequence[Mapping[str, Any]], system: str | None = None) -> str:
        # Kimi's own templates declare tools in a system message of their own; this is for a
        # template without tool support that is given this parser.
        declared = json.dumps(list(tools), ensure_ascii=False)
        text = (
            "# Tools\n\nYou may call the functions declared here to assist with the user query:\n"
            f"{declared}\n\n"
            f"To call functions, write {SECTION_BEGIN}, then for each call {CALL_BEGIN}"
            f"functions.NAME:INDEX{ARGUMENT_BEGIN}ARGUMENTS-JSON-OBJECT{CALL_END}, then {SECTION_END}."
        )
        return f"{system}\n\n{text}" if system else text

    def render_tool_calls(self, calls: Sequence[ToolCall | Mapping[str, Any]]) -> str:
        parts = [SECTION_BEGIN]
        for index, call in enumerate(calls):
            name, args = history_call(call)
            call_id = call.id if isinstance(call, ToolCall) else call.get("id")
            if not (isinstance(call_id, str) and _KIMI_ID.fullmatch(call_id)):
                call_id = kimi_call_id(name, index)
            arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            parts.append(f"{CALL_BEGIN}{call_id}{ARGUMENT_BEGIN}{arguments}{CALL_END}")
        parts.append(SECTION_END)
        return "".join(parts)

    def render_assistant(self, content: str | None, calls: Sequence[ToolCall | Mapping[str, Any]]) -> str:
        # Kimi writes the section straight after its text, with no separating newline.
        if not calls:
            return content or ""
        return f"{content or ''}{self.render_tool_calls(calls)}"

    def render_tool_result(self, content: str, name: str | None = None) -> str:
        # Kimi's template heads a result with the call's id; by name is what is known here.
        return f"## Return of {name}\n{content}" if name else content


class _Where(enum.Enum):
    TEXT = "text"  # outside a section
    SECTION = "section"  # between calls of a section
    CALL = "call"  # inside a call, before its end marker


class KimiK2StreamParser(ToolStreamParser):
    def __init__(self) -> None:
        self._where = _Where.TEXT
        self._buf = ""  # undecided text: a possible marker start, or a call's body so far
        self._pending_ws = ""  # trailing whitespace of the text: dropped if a section follows
        self._after_call = False  # calls but no text yet: whitespace is dropped until text comes
        self._emitted_text = False
        self._num_calls = 0

    @property
    def called_tools(self) -> bool:
        return self._num_calls > 0

    def feed(self, text_delta: str) -> StreamDelta:
        out = StreamDelta()
        self._buf += text_delta
        while self._step(out):
            pass
        return out

    def _step(self, out: StreamDelta) -> bool:
        """Decide what can be decided at the start of the buffer; False when it must wait."""
        if self._where is _Where.TEXT:
            begin = _first(self._buf, (SECTION_BEGIN, CALL_BEGIN))
            if begin is None:
                keep = max(partial_suffix(self._buf, SECTION_BEGIN), partial_suffix(self._buf, CALL_BEGIN))
                self._text(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep :]
                return False
            at, marker = begin
            self._text(self._buf[:at], out)
            self._pending_ws = ""  # whitespace before a section only separated it
            self._buf = self._buf[at + len(marker) :]
            self._where = _Where.CALL if marker == CALL_BEGIN else _Where.SECTION
            return True
        if self._where is _Where.SECTION:
            rest = self._buf.lstrip()
            if not rest:
                self._buf = ""
                return False
            for marker, where in ((CALL_BEGIN, _Where.CALL), (SECTION_END, _Where.TEXT)):
                if rest.startswith(marker):
                    self._buf = rest[len(marker) :]
                    self._where = where
                    return True
            if CALL_BEGIN.startswith(rest) or SECTION_END.startswith(rest):
                self._buf = rest
                return False
            self._where = _Where.TEXT  # anything else ends the section: it is text again
            self._buf = rest
            return True
        end = self._buf.find(CALL_END)
        if end < 0:
            return False
        self._close_call(self._buf[:end], CALL_BEGIN + self._buf[: end + len(CALL_END)], out)
        self._buf = self._buf[end + len(CALL_END) :]
        self._where = _Where.SECTION
        return True

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self._where is _Where.CALL:
            # Stopped inside a call (a stop string, max_tokens): it counts if its arguments
            # are complete, a cut-off end marker included.
            body = self._buf
            complete = body[: len(body) - partial_suffix(body, CALL_END)]
            self._close_call(complete, CALL_BEGIN + body, out)
        elif self._where is _Where.TEXT:
            self._text(self._buf, out)
        self._buf = ""
        self._where = _Where.TEXT
        if self._emitted_text and self._pending_ws:
            out.content += self._pending_ws
        self._pending_ws = ""
        return out

    def _text(self, text: str, out: StreamDelta) -> None:
        """Text outside calls; trailing whitespace waits to see whether a section follows."""
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
            logger.debug("Kimi-K2 tool call does not parse; returned as text: %r", raw)
            out.content += self._pending_ws + raw
            self._pending_ws = ""
            self._emitted_text = True
            return
        # Text after the calls keeps its leading whitespace only if it continues earlier text.
        self._after_call = not self._emitted_text
        out.tool_calls.append(ToolCallDelta(index=self._num_calls, id=call.id, name=call.name,
                                            arguments=call.arguments))
        self._num_calls += 1


def _first(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """The earliest of `markers` in `text` (position, marker), or None."""
    found = [(at, marker) for marker in markers if (at := text.find(marker)) >= 0]
    return min(found) if found else None
