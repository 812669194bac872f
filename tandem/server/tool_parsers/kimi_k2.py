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

The section is read by the parser Kimi-K2 and DeepSeek share (sections.py); this module
decodes a call's body and writes calls back.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from tandem.server.tool_parsers.base import (
    CallShape,
    ToolCall,
    ToolParser,
    history_call,
    object_arguments,
)
from tandem.server.tool_parsers.sections import SectionMarkers, SectionStreamParser

logger = logging.getLogger(__name__)

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_INDEX = "\x00index\x00"  # where a call's number goes, in call_shape
MARKERS = SectionMarkers(SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END)

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
    args = object_arguments(arguments)
    if args is None:
        return None
    name, index = match.group(1), int(match.group(2))
    return ToolCall(id=kimi_call_id(name, index), name=name, arguments=args)


class KimiK2ToolParser(ToolParser):
    """Kimi-K2 (Instruct, Thinking, K2.5) tool-call sections."""

    name = "kimi_k2"
    preserved_tokens = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)

    def stream(self, prefix: str = "", tool_names: Collection[str] = ()) -> SectionStreamParser:
        del tool_names  # the format is unambiguous: no declared name is needed to accept a call
        parser = SectionStreamParser(MARKERS, _decode_call, "Kimi-K2")
        if prefix:
            parser.feed(prefix)
        return parser

    def call_shape(self) -> CallShape:
        return CallShape(SECTION_BEGIN, "", SECTION_END,
                         lambda name: f"{CALL_BEGIN}functions.{name}:{_INDEX}{ARGUMENT_BEGIN}",
                         lambda name: CALL_END, call_index=_INDEX)

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
