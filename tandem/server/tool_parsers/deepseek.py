"""DeepSeek-V3 and DeepSeek-V3.1 tool calls: special-token sections, two ways to write a call.

Both models write their calls after any text, in one section of DeepSeek's special tokens
(fullwidth bars, U+FF5C, and "▁", U+2581, in their names). They differ in the call itself:

    V3 (V3, V3-0324, R1):  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
                           ```json
                           {"city": "Paris"}
                           ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    V3.1 (and V3.2-Exp):   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

so one streaming parser reads the sections for both and hands each call's body (the text
between `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`) to the format's decoder.

The markers are special tokens of DeepSeek's vocabulary, which a detokenizer that skips
special tokens drops: `preserved_tokens` names them, and the server keeps their text (and
only theirs) in the output this parser reads.

The section is read by the parser DeepSeek and Kimi-K2 share (sections.py); this module
decodes a call's body and writes calls back. Call ids are OpenAI-style: neither format writes
one.
"""

from __future__ import annotations

import json
import logging
import re
from abc import abstractmethod
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

from tandem.server.tool_parsers.base import (
    CallShape,
    ToolCall,
    ToolParser,
    history_call,
    new_call_id,
    object_arguments,
)
from tandem.server.tool_parsers.sections import SectionMarkers, SectionStreamParser

logger = logging.getLogger(__name__)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
MARKERS = SectionMarkers(CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END)
# Prompt-side only (the template wraps tool results in them); the model never writes them.
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"

# A function name: OpenAI's letters, digits, "_" and "-", plus the dots, colons and slashes
# of namespaced (MCP) tools.
_NAME = r"[\w.:/\-]{1,128}"
# V3: `function<｜tool▁sep｜>NAME`, a ```json fence, the arguments, the closing fence. The
# fences are optional (a call cut off by a stop string or max_tokens loses its closing one).
_V3_BODY = re.compile(
    rf"\s*function\s*{re.escape(SEP)}\s*({_NAME})\s*(?:```(?:json)?)?(.*?)`{{0,3}}\s*", re.DOTALL
)
# V3.1: `NAME<｜tool▁sep｜>ARGUMENTS`.
_V31_BODY = re.compile(rf"\s*({_NAME})\s*{re.escape(SEP)}(.*)", re.DOTALL)


def _call(name: str, arguments: str) -> ToolCall | None:
    """A call from its name and arguments text, or None unless the text is a JSON object
    (empty text counts as `{}`, as a function without parameters may be called)."""
    args = object_arguments(arguments)
    return None if args is None else ToolCall(id=new_call_id(), name=name, arguments=args)


def decode_v3_call(body: str) -> ToolCall | None:
    match = _V3_BODY.fullmatch(body)
    return _call(match.group(1), match.group(2)) if match else None


def decode_v31_call(body: str) -> ToolCall | None:
    match = _V31_BODY.fullmatch(body)
    return _call(match.group(1), match.group(2)) if match else None


class DeepSeekToolParser(ToolParser):
    """What the two formats share: the section, the prompt text and the result wrapping.
    A format supplies how a call's body starts and ends, and its decoder."""

    preserved_tokens = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
    # Between two calls of a section, as the format's chat template writes them.
    call_separator: ClassVar[str] = ""

    @abstractmethod
    def call_header(self, name: str) -> str:
        """The body of a call up to where its arguments start."""

    @abstractmethod
    def call_footer(self) -> str:
        """The body of a call after its arguments."""

    @abstractmethod
    def decode_call(self, body: str) -> ToolCall | None:
        """A call's body (between its begin and end markers) as a call, or None."""

    def stream(self, prefix: str = "", tool_names: Collection[str] = ()) -> SectionStreamParser:
        del tool_names  # the format is unambiguous: no declared name is needed to accept a call
        parser = SectionStreamParser(MARKERS, self.decode_call, "DeepSeek")
        if prefix:
            parser.feed(prefix)
        return parser

    def call_shape(self) -> CallShape:
        return CallShape(CALLS_BEGIN, self.call_separator, CALLS_END,
                         lambda name: CALL_BEGIN + self.call_header(name),
                         lambda name: self.call_footer() + CALL_END)

    def forced_prefix(self, name: str | None) -> str:
        if name is None:
            return CALLS_BEGIN + CALL_BEGIN
        return CALLS_BEGIN + CALL_BEGIN + self.call_header(name)

    def stop_strings(self, parallel_tool_calls: bool = True) -> list[str]:
        return [] if parallel_tool_calls else [CALL_END]

    def system_prompt(self, tools: Sequence[Mapping[str, Any]], system: str | None = None) -> str:
        # Laid out as DeepSeek documents tools for V3.1 (whose template has no `tools`):
        # "## Tools", then each function under "### NAME" with its description and schema.
        described = []
        for tool in tools:
            function = tool.get("function", tool)
            parameters = json.dumps(function.get("parameters", {}), ensure_ascii=False)
            described.append(
                f"### {function.get('name', '')}\nDescription: {function.get('description', '')}"
                f"\n\nParameters: {parameters}\n"
            )
        example = (CALL_BEGIN + self.call_header("TOOL_NAME") + "ARGUMENTS" + self.call_footer()
                   + CALL_END)
        text = (
            "## Tools\nYou have access to the following tools:\n\n" + "\n".join(described)
            + "\nTo use tools, answer in exactly this format:\n"
            f"{CALLS_BEGIN}{example}{self.call_separator}...{CALLS_END}\n\n"
            "where TOOL_NAME is the exact name of one of the tools above and ARGUMENTS a JSON "
            "object that follows its Parameters schema; repeat the call part for more calls."
        )
        return f"{system}\n\n{text}" if system else text

    def render_tool_calls(self, calls: Sequence[ToolCall | Mapping[str, Any]]) -> str:
        rendered = []
        for call in calls:
            name, args = history_call(call)
            arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            rendered.append(CALL_BEGIN + self.call_header(name) + arguments + self.call_footer()
                            + CALL_END)
        return CALLS_BEGIN + self.call_separator.join(rendered) + CALLS_END

    def render_assistant(self, content: str | None, calls: Sequence[ToolCall | Mapping[str, Any]]) -> str:
        # DeepSeek's templates write the section straight after the text.
        if not calls:
            return content or ""
        return (content or "") + self.render_tool_calls(calls)

    def render_tool_result(self, content: str, name: str | None = None) -> str:
        del name  # DeepSeek's templates give results in the calls' order, unnamed
        return OUTPUT_BEGIN + content + OUTPUT_END


class DeepSeekV3ToolParser(DeepSeekToolParser):
    """DeepSeek-V3 / V3-0324 (and R1): `function<｜tool▁sep｜>NAME` and fenced JSON arguments."""

    name = "deepseek_v3"
    call_separator = "\n"  # V3's template puts each further call on a new line

    def call_header(self, name: str) -> str:
        return f"function{SEP}{name}\n```json\n"

    def call_footer(self) -> str:
        return "\n```"

    def decode_call(self, body: str) -> ToolCall | None:
        return decode_v3_call(body)


class DeepSeekV31ToolParser(DeepSeekToolParser):
    """DeepSeek-V3.1 (and V3.2-Exp): `NAME<｜tool▁sep｜>ARGUMENTS`."""

    name = "deepseek_v31"

    def call_header(self, name: str) -> str:
        return name + SEP

    def call_footer(self) -> str:
        return ""

    def decode_call(self, body: str) -> ToolCall | None:
        return decode_v31_call(body)
