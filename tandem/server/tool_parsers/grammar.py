"""A grammar that lets the model write only tool calls that parse and name a declared tool.

Built from the format's `CallShape` (base.py) and the request's tool schemas, in Lark for
llguidance (tandem/structured): the format's envelope around each call is fixed text (a
special token where the vocabulary has one: the model writes `<tool_call>` as one token, and a
grammar must name that token), and each tool's arguments are generated under that tool's JSON
schema (as one JSON object, or as the format writes them: Qwen3-Coder's XML parameters). Used for `tool_choice` "required" (one or more calls, nothing else), a named function
(one call of it) and, under "auto", tools declared `strict: true`: free text, then, once the
model opens a call section, only valid calls. Under "auto" a format whose section does not open
with a special token cannot tell text from a call's start, so it stays free (None).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from tandem.server.tool_parsers.base import CallShape, ToolParser

# Lenient: a keyword llguidance cannot enforce (`uniqueItems`) is left unchecked, not a refusal;
# agents send whatever schemas their tools have, and a call that parses beats a 400.
_JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "lenient": True}


def tool_call_grammar(parser: ToolParser, tools: Mapping[str, dict[str, Any]], special_tokens: Mapping[str, int],
                      *, required: bool, parallel: bool = True) -> str | None:
    """Lark for calls of `tools` (name -> parameters schema) in `parser`'s format; `required`:
    calls only, else free text may come instead of or before them. None: no grammar fits."""
    shape = parser.call_shape()
    if shape is None or not tools:
        return None
    literal = _Literal(special_tokens)
    if not required and not literal.starts_special(shape.section_begin or shape.before(next(iter(tools)))):
        return None
    rules = ["%llguidance {}"]
    more = f" ({literal(shape.separator)} call)*" if parallel else ""
    if required:
        rules.append("start: calls")
    elif shape.bare:
        # A small model that means to call under "auto" often drops the markers and writes the
        # call's JSON alone (Qwen2.5-Coder-0.5B: most of its calls); its parser reads that too,
        # so the grammar lets it, checked like any call, alone or in one ```json fence.
        bare_more = ' ("\\n" call)*' if parallel else ""
        rules.append('start: TEXT | TEXT? calls | bare | "```json\\n" bare "\\n```"')
        rules.append(f'bare: call{bare_more} "\\n"?')
    else:
        rules.append("start: TEXT | TEXT? calls")
    # A newline may close the section: a model that writes one after its last call must not
    # find a further call forced on it (after "\n" the grammar would allow only another call).
    rules.append(f'calls: {literal(shape.section_begin)} call{more} {literal(shape.section_end)} "\\n"?')
    alternatives = []
    write_arguments = shape.arguments or _json_arguments
    for index, (name, schema) in enumerate(tools.items()):
        alternatives.append(f"call_{index}")
        before = literal(shape.before(name), shape.call_index)
        rules.append(f"call_{index}: {before} args_{index} {literal(shape.after(name))}")
        rules.extend(write_arguments(f"args_{index}", schema if isinstance(schema, Mapping) else {}))
    rules.append("call: " + " | ".join(alternatives))
    if not required:
        # Free text, but not a call written some other way: a small model that means to call
        # writes bare JSON (or fences it) as often as its format's envelope, and a parser that
        # recovers such a call would hand back arguments no grammar checked. Text may not start
        # with `{`, `[` or a backtick, so the model's call goes through the envelope (or the
        # bare form above, checked the same, where the parser reads one).
        rules.append("TEXT: /(?s:[^{\\[`\\s].*|\\s+[^{\\[`\\s].*)/")
    return "\n".join(rule.replace('""', "").strip() for rule in rules) + "\n"


def _json_arguments(rule: str, schema: Mapping[str, Any]) -> list[str]:
    """The arguments as one JSON object under the tool's parameters schema."""
    return [f"{rule}: {json_value(schema or {'type': 'object'})}"]


def json_value(schema: Mapping[str, Any]) -> str:
    """A Lark term for JSON under `schema`, written as the model writes it (`, ` and `: `)."""
    schema = dict(schema)
    schema.setdefault("x-guidance", _JSON_OPTIONS)
    return f"%json {json.dumps(schema, ensure_ascii=False)}"


class _Literal:
    """Text as Lark terms: a special token by its id (`<[id]>`), the rest as strings."""

    def __init__(self, special_tokens: Mapping[str, int]) -> None:
        self._special = {text: token for text, token in special_tokens.items() if text}
        names = sorted(self._special, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(n) for n in names)) if names else None

    def starts_special(self, text: str) -> bool:
        return self._pattern is not None and self._pattern.match(text) is not None

    def __call__(self, text: str, index_marker: str = "") -> str:
        terms = []
        pieces = text.split(index_marker) if index_marker else [text]
        for number, piece in enumerate(pieces):
            if number:
                # Bounded: a model that repeats a digit must not write it forever.
                terms.append("/0|[1-9][0-9]{0,4}/")
            terms.extend(self._terms(piece))
        return " ".join(terms) if terms else '""'

    def _terms(self, text: str) -> list[str]:
        terms: list[str] = []
        position = 0
        for match in self._pattern.finditer(text) if self._pattern is not None else ():
            if match.start() > position:
                terms.append(json.dumps(text[position:match.start()], ensure_ascii=False))
            terms.append(f"<[{self._special[match.group()]}]>")
            position = match.end()
        if position < len(text):
            terms.append(json.dumps(text[position:], ensure_ascii=False))
        return terms


__all__ = ["CallShape", "json_value", "tool_call_grammar"]
