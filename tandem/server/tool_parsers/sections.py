"""Calls written in one marked section after the text: Kimi-K2's and DeepSeek's formats.

    TEXT <section begin><call begin>BODY<call end><call begin>BODY<call end><section end>

Kimi-K2 and DeepSeek-V3 / V3.1 write their calls this way with special tokens of their own;
they differ only in the markers and in a call's BODY (`functions.NAME:IDX` + marker + JSON,
`function` + sep + NAME + fenced JSON, NAME + sep + JSON). So one streaming parser reads the
sections for all of them and hands each body to the format's decoder.

A call is emitted whole when its end marker arrives; text that may still become a marker is
held back. A call written without its section is read as one, as the model clearly meant it.
A body that does not decode comes back as text, markers included. A call cut off at the end of
the output (a stop string, max_tokens) counts if its body decodes without the end marker.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

from tandem.server.tool_parsers.base import (
    ContentSpacing,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolStreamParser,
    partial_suffix,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SectionMarkers:
    section_begin: str
    section_end: str
    call_begin: str
    call_end: str


class _State(enum.Enum):
    TEXT = "text"  # outside a section
    SECTION = "section"  # inside a section, between calls
    CALL = "call"  # inside a call, before its end marker


class SectionStreamParser(ToolStreamParser):
    """Sections and calls; `decode` turns a call's body into a call (None: it is text)."""

    def __init__(self, markers: SectionMarkers, decode: Callable[[str], ToolCall | None], format_name: str) -> None:
        self._m = markers
        self._decode = decode
        self._format_name = format_name
        self._state = _State.TEXT
        self._buf = ""  # not yet decided: a possible partial marker, or a call's body so far
        self._spacing = ContentSpacing()
        self._calls = 0

    @property
    def called_tools(self) -> bool:
        return self._calls > 0

    def feed(self, text_delta: str) -> StreamDelta:
        out = StreamDelta()
        self._buf += text_delta
        while self._advance(out):
            pass
        return out

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self._state is _State.CALL:
            body = self._buf[: len(self._buf) - partial_suffix(self._buf, self._m.call_end)]
            self._close_call(body, self._m.call_begin + self._buf, out)
        elif self._state is _State.TEXT:
            self._spacing.text(self._buf, out)
        # In a section, what is left is whitespace or a partial marker: dropped.
        self._spacing.flush(out)
        self._buf, self._state = "", _State.TEXT
        return out

    def _advance(self, out: StreamDelta) -> bool:
        """Consume what can be decided at the start of the buffer; False to wait for more."""
        if self._state is _State.TEXT:
            return self._advance_text(out)
        if self._state is _State.SECTION:
            return self._advance_section()
        end = self._buf.find(self._m.call_end)
        if end < 0:
            return False
        body, self._buf = self._buf[:end], self._buf[end + len(self._m.call_end):]
        self._close_call(body, self._m.call_begin + body + self._m.call_end, out)
        self._state = _State.SECTION
        return True

    def _advance_text(self, out: StreamDelta) -> bool:
        begins = (self._m.section_begin, self._m.call_begin)
        starts = [(at, marker) for marker in begins if (at := self._buf.find(marker)) >= 0]
        if not starts:
            cut = len(self._buf) - max(partial_suffix(self._buf, marker) for marker in begins)
            self._spacing.text(self._buf[:cut], out)
            self._buf = self._buf[cut:]
            return False
        at, marker = min(starts)
        self._spacing.text(self._buf[:at], out)
        self._spacing.drop_pending()  # it only separated the text from the calls
        self._buf = self._buf[at + len(marker):]
        self._state = _State.CALL if marker == self._m.call_begin else _State.SECTION
        return True

    def _advance_section(self) -> bool:
        rest = self._buf = self._buf.lstrip()
        for marker, state in ((self._m.call_begin, _State.CALL), (self._m.section_end, _State.TEXT)):
            if rest.startswith(marker):
                self._buf, self._state = rest[len(marker):], state
                return True
        if not rest or self._m.call_begin.startswith(rest) or self._m.section_end.startswith(rest):
            return False
        self._state = _State.TEXT  # anything else ends the section: it is text again
        return True

    def _close_call(self, body: str, raw: str, out: StreamDelta) -> None:
        call = self._decode(body)
        if call is None:
            logger.debug("%s tool call does not decode; returned as text: %r", self._format_name, raw)
            self._spacing.raw(raw, out)
            return
        self._spacing.call_emitted()
        out.tool_calls.append(ToolCallDelta(index=self._calls, id=call.id, name=call.name, arguments=call.arguments))
        self._calls += 1
