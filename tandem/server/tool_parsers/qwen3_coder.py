"""Qwen3-Coder tool calls: XML-like blocks whose parameter values are raw, untyped text.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The newline after `<parameter=NAME>` and the one before `</parameter>` are layout, not value.
A value carries no type of its own, so each one takes the type its function's JSON schema
declares for it (the server passes `tool_names` as {name: parameters schema}); without a
schema, or when the text does not fit the type, the value stays a string.

Values can be long (whole files, for a coding agent), so unlike Hermes a call is streamed
piece by piece: its name as soon as its body starts, then each argument when its
`</parameter>` arrives (`{"city": "Paris"`, `, "days": 3`) and `}` at `</function>`.

Pieces already sent cannot be taken back, which fixes the rule for broken markup. A call is
committed (its first piece sent) once `<function=NAME>` is followed by a complete
`<parameter=NAME>`, `</function>` or `</tool_call>`; not at `<function=NAME>` itself,
because a forced prefix ends there and feeding it must emit nothing (see `base`). Before that point
broken markup makes the whole block text, as the other parsers do. After it, broken markup
(text between parameters, a bad parameter name, a value still open at the end of the
output) ends the call with the arguments completed so far, and what follows is text again:
the client gets a valid call plus, as content, what the model wrote that was not one. A
call cut off at the end of the output (a stop string, max_tokens) therefore counts when no
parameter was left open. `parse` runs the same streaming parser over the whole text, so
both modes apply this rule identically.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.server.tool_parsers.base import (
    CallShape,
    ContentSpacing,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamParser,
    history_call,
    new_call_id,
    partial_suffix,
)
from tandem.server.tool_parsers.grammar import json_value

logger = logging.getLogger(__name__)

START = "<tool_call>"
END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"

# What follows `<function=` / `<parameter=`: the name, then `>` (if written yet).
_NAME = re.compile(r"([^\s<>]*)(>?)")
_INTEGER = re.compile(r"[-+]?\d+")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_JSON_TYPES: Mapping[str, type] = {"object": dict, "array": list, "null": type(None)}


class _NoValue(Exception):
    """The text does not fit the type being tried."""


def _reject_constant(name: str) -> Any:
    raise _NoValue(name)  # NaN / Infinity: Python's json accepts them, JSON does not


def _as_type(text: str, kind: str) -> Any:
    """`text` as a value of JSON-schema type `kind`; raises _NoValue when it is not one."""
    text = text.strip()
    if kind in ("integer", "number") and _INTEGER.fullmatch(text):
        try:
            return int(text)
        except ValueError:  # more digits than Python converts
            raise _NoValue(text) from None
    if kind == "number" and _NUMBER.fullmatch(text):
        number = float(text)
        if math.isfinite(number):
            return number
    elif kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    elif kind in _JSON_TYPES:
        try:
            value = json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            raise _NoValue(text) from None
        if isinstance(value, _JSON_TYPES[kind]):
            return value
    raise _NoValue(text)


def _schema_types(schema: Any) -> list[str]:
    """The types a JSON schema allows, in order: `type` (a name or a list), else the types
    of its `anyOf` / `oneOf` alternatives. Empty when it says nothing usable."""
    if not isinstance(schema, Mapping):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [kind for kind in declared if isinstance(kind, str)]
    types: list[str] = []
    for key in ("anyOf", "oneOf"):
        alternatives = schema.get(key)
        if isinstance(alternatives, list):
            for alternative in alternatives:
                types.extend(kind for kind in _schema_types(alternative) if kind not in types)
    return types


def convert_value(text: str, schema: Any) -> Any:
    """A raw parameter value typed by its schema: each non-string type the schema allows is
    tried in order, and the text stays a string when none fits (or none is declared)."""
    for kind in _schema_types(schema):
        if kind == "string":
            continue
        try:
            return _as_type(text, kind)
        except _NoValue:
            continue
    return text


def _parameter_schemas(tool_names: Collection[str], name: str) -> Mapping[str, Any]:
    """The `properties` of function `name`'s parameters schema, or {} if none was passed."""
    if not isinstance(tool_names, Mapping):
        return {}
    schema = tool_names.get(name)
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    return properties if isinstance(properties, Mapping) else {}


def _opening(text: str, marker: str) -> tuple[str, int] | bool:
    """`marker` + NAME + `>` at the start of `text`: (NAME, length of it all) when complete,
    else whether `text` may still become one. NAME is non-empty, without spaces or `<>`."""
    if not text.startswith(marker):
        return marker.startswith(text)
    match = _NAME.match(text, len(marker))
    assert match is not None  # the pattern matches the empty string
    name, closed = match.groups()
    if closed:
        return (name, match.end()) if name else False
    return match.end() == len(text)


# A raw value is text without `</parameter>` (the parser ends the value at the first one).
_NO_CLOSING_TAG = '~/(?s:.*<\\/parameter>.*)/'


_MAX_BOUND = 65536


def _raw_value(schema: Mapping[str, Any]) -> str:
    """A raw value's terminal, as long as the schema's minLength / maxLength allow."""
    low, high = schema.get("minLength"), schema.get("maxLength")
    low = low if isinstance(low, int) and not isinstance(low, bool) and low > 0 else 0
    high = high if isinstance(high, int) and not isinstance(high, bool) and high >= low else None
    low = min(low, _MAX_BOUND)  # a client's bound stays a small regex; past it, unbounded
    high = None if high is not None and high > _MAX_BOUND else high
    count = "*" if not low and high is None else f"{{{low},{'' if high is None else high}}}"
    return f"/(?s:.{count})/ & {_NO_CLOSING_TAG}"


def xml_arguments(rule: str, schema: Mapping[str, Any]) -> list[str]:
    """Lark rules for one call's parameters under its JSON schema, as the parser reads them:
    the declared parameters in the schema's order, each required one present; a value the
    schema types as a string (or leaves untyped) is raw text (its length bounded by
    minLength / maxLength), an enum one of its values as
    render_tool_calls writes them, any other type JSON under its schema. A schema without
    `properties` takes any parameter names with raw values."""
    properties = schema.get("properties")
    if not isinstance(properties, Mapping) or not properties:
        return [f"{rule}: {rule}_any*",
                f'{rule}_any: "{PARAMETER}" /[^\\s<>]+/ ">\\n" {rule}_raw "\\n"',
                f'{rule}_raw[lazy]: {rule.upper()}_RAW "\\n{PARAMETER_END}"',
                f"{rule.upper()}_RAW: {_raw_value({})}"]
    required = schema.get("required")
    required = set(required) if isinstance(required, list) else set()
    terms, rules = [], []
    for index, (name, value_schema) in enumerate(properties.items()):
        part = f"{rule}_{index}"
        terms.append(part if name in required else f"{part}?")
        opening = json.dumps(f"{PARAMETER}{name}>\n", ensure_ascii=False)
        value_schema = value_schema if isinstance(value_schema, Mapping) else {}
        value = _xml_value(value_schema)
        if value is None:  # raw text, ended by the first </parameter>
            rules += [f'{part}: {opening} {part}_raw "\\n"',
                      f'{part}_raw[lazy]: {part.upper()}_RAW "\\n{PARAMETER_END}"',
                      f"{part.upper()}_RAW: {_raw_value(value_schema)}"]
        else:
            closing = json.dumps(f"\n{PARAMETER_END}\n")
            rules.append(f"{part}: {opening} {value} {closing}")
    return [f"{rule}: {' '.join(terms)}", *rules]


def _xml_value(schema: Mapping[str, Any]) -> str | None:
    """A parameter value's Lark term; None: raw text."""
    choices = schema.get("enum")
    if "const" in schema:
        choices = [schema["const"]]
    if isinstance(choices, list) and choices:
        texts = {value if isinstance(value, str) else json.dumps(value, ensure_ascii=False) for value in choices}
        return "(" + " | ".join(json.dumps(text, ensure_ascii=False) for text in sorted(texts)) + ")"
    types = _schema_types(schema)
    if not types or "string" in types:
        return None
    return json_value(schema)


class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder's XML tool calls (Qwen3.5 writes the same), possibly several in a row."""

    name = "qwen3_coder"

    def stream(self, prefix: str = "", tool_names: Collection[str] = ()) -> Qwen3CoderStreamParser:
        parser = Qwen3CoderStreamParser(tool_names)
        if prefix:
            parser.feed(prefix)
        return parser

    def call_shape(self) -> CallShape:
        # As render_tool_calls writes them; the parameters are written by xml_arguments.
        return CallShape(f"{START}\n", f"\n{END}\n{START}\n", f"\n{END}",
                         lambda name: f"{FUNCTION}{name}>\n", lambda name: FUNCTION_END,
                         arguments=xml_arguments)

    def forced_prefix(self, name: str | None) -> str:
        if name is None:
            return f"{START}\n"
        return f"{START}\n{FUNCTION}{name}>\n"

    def stop_strings(self, parallel_tool_calls: bool = True) -> list[str]:
        return [] if parallel_tool_calls else [END]

    def system_prompt(self, tools: Sequence[Mapping[str, Any]], system: str | None = None) -> str:
        # The wording Qwen3-Coder's template uses, so the model sees what it was trained on.
        lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        text = (
            "# Tools\n\nYou have access to the following functions:\n\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "If you choose to call a function ONLY reply in the following format with NO "
            "suffix:\n\n"
            f"{START}\n{FUNCTION}example_function_name>\n{PARAMETER}example_parameter_1>\n"
            f"value_1\n{PARAMETER_END}\n{PARAMETER}example_parameter_2>\n"
            "This is the value for the second parameter\nthat can span\nmultiple lines\n"
            f"{PARAMETER_END}\n{FUNCTION_END}\n{END}\n\n"
            "<IMPORTANT>\nReminder:\n"
            "- Function calls MUST follow the specified format: an inner <function=...>"
            "</function> block must be nested within <tool_call></tool_call> XML tags\n"
            "- Required parameters MUST be specified\n"
            "- You may provide optional reasoning for your function call in natural language "
            "BEFORE the function call, but NOT after\n"
            "- If there is no function call available, answer the question like normal with "
            "your current knowledge and do not tell the user about function calls\n"
            "</IMPORTANT>"
        )
        return f"{system}\n\n{text}" if system else text

    def render_tool_calls(self, calls: Sequence[ToolCall | Mapping[str, Any]]) -> str:
        blocks = []
        for call in calls:
            name, args = history_call(call)
            lines = [START, f"{FUNCTION}{name}>"]
            if isinstance(args, Mapping):  # arguments that are not an object have no names
                for key, value in args.items():
                    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
                    lines += [f"{PARAMETER}{key}>", text, PARAMETER_END]
            lines += [FUNCTION_END, END]
            blocks.append("\n".join(lines))
        return "\n".join(blocks)

    def render_tool_result(self, content: str, name: str | None = None) -> str:
        del name  # results follow the calls' order, as in Qwen's template
        return f"<tool_response>\n{content}\n</tool_response>"


class _Where(enum.Enum):
    TEXT = "text"  # outside calls
    OPEN = "open"  # after <tool_call>, before a complete <function=NAME>
    BODY = "body"  # in a function, between its parameters
    VALUE = "value"  # in a parameter's value, before its </parameter>
    CLOSED = "closed"  # after </function>, before </tool_call>


@dataclass
class _Call:
    name: str
    parameters: Mapping[str, Any]  # parameter name -> its JSON schema
    index: int | None = None  # set when committed: its first piece is sent
    keys: set[str] = field(default_factory=set)  # parameters sent so far


class Qwen3CoderStreamParser(ToolStreamParser):
    """Text streams at once except a possible `<tool_call>` start and trailing whitespace;
    a call streams from its commitment on (see the module docstring)."""

    def __init__(self, tool_names: Collection[str] = ()) -> None:
        self._tool_names = tool_names
        self._where = _Where.TEXT
        self._buf = ""  # text not yet decided
        self._raw = ""  # an uncommitted call's text after <tool_call>: text again if broken
        self._call: _Call | None = None
        self._param = ""  # the open parameter's name, in VALUE
        self._param_raw = ""  # and its opening markup, text again if it is never closed
        self._scan_from = 0  # where to resume looking for </parameter> in a value
        self._spacing = ContentSpacing()
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

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        while True:
            while self._step(out):
                pass
            if self._where is _Where.TEXT:
                break
            self._cut_off(out)
        self._text(self._buf, out)
        self._buf = ""
        self._spacing.flush(out)
        return out

    def _step(self, out: StreamDelta) -> bool:
        """Decide what can be decided at the start of the buffer; False when it must wait."""
        if self._where is _Where.TEXT:
            return self._step_text(out)
        if self._where is _Where.OPEN:
            return self._step_open(out)
        if self._where is _Where.BODY:
            return self._step_body(out)
        if self._where is _Where.VALUE:
            return self._step_value(out)
        return self._step_closed()

    def _step_text(self, out: StreamDelta) -> bool:
        start = self._buf.find(START)
        if start < 0:
            keep = partial_suffix(self._buf, START)
            self._text(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._text(self._buf[:start], out)
        self._buf = self._buf[start + len(START) :]
        self._raw = ""
        self._where = _Where.OPEN
        return True

    def _step_open(self, out: StreamDelta) -> bool:
        rest = self._buf.lstrip()
        opening = _opening(rest, FUNCTION)
        if isinstance(opening, tuple):
            name, length = opening
            self._call = _Call(name, _parameter_schemas(self._tool_names, name))
            self._consume(len(self._buf) - len(rest) + length)
            self._where = _Where.BODY
            return True
        if opening:
            return False
        self._broken(out)
        return True

    def _step_body(self, out: StreamDelta) -> bool:
        # Whitespace is consumed only with the marker after it, so that text after broken
        # markup comes out the same however the deltas split it.
        rest = self._buf.lstrip()
        skipped = len(self._buf) - len(rest)
        for marker, where in ((FUNCTION_END, _Where.CLOSED), (END, _Where.TEXT)):
            if rest.startswith(marker):
                self._commit(out)
                self._consume(skipped + len(marker))
                self._close_arguments(out)
                self._where = where
                return True
        opening = _opening(rest, PARAMETER)
        if isinstance(opening, tuple):
            self._commit(out)
            self._param, length = opening
            self._param_raw = self._buf[: skipped + length]
            self._consume(skipped + length)
            self._scan_from = 0
            self._where = _Where.VALUE
            return True
        if opening or FUNCTION_END.startswith(rest) or END.startswith(rest):
            return False
        self._broken(out)
        return True

    def _step_value(self, out: StreamDelta) -> bool:
        end = self._buf.find(PARAMETER_END, self._scan_from)
        if end < 0:
            self._scan_from = max(0, len(self._buf) - len(PARAMETER_END) + 1)
            return False
        value = self._buf[:end].removeprefix("\n").removesuffix("\n")
        self._buf = self._buf[end + len(PARAMETER_END) :]
        self._add_parameter(self._param, value, out)
        self._where = _Where.BODY
        return True

    def _step_closed(self) -> bool:
        rest = self._buf.lstrip()
        if rest.startswith(END):
            self._buf = rest[len(END) :]
        elif END.startswith(rest):
            return False
        # Anything but </tool_call> after </function> is text (the call is complete).
        self._where = _Where.TEXT
        return True

    def _cut_off(self, out: StreamDelta) -> None:
        """End of output inside a call: it counts if no parameter was left open (a cut-off
        end marker is dropped); otherwise it is text, or, once committed, ends there."""
        rest = self._buf.lstrip()
        if self._where is _Where.BODY and (FUNCTION_END.startswith(rest) or END.startswith(rest)):
            self._commit(out)
            self._close_arguments(out)
            self._buf = ""
            self._where = _Where.TEXT
        elif self._where is _Where.CLOSED:
            self._buf = ""
            self._where = _Where.TEXT
        else:
            if self._where is _Where.VALUE:
                self._buf = self._param_raw + self._buf
            self._broken(out)

    def _broken(self, out: StreamDelta) -> None:
        """The call's markup is broken at the start of the buffer: an uncommitted call is
        all text, a committed one ends here; either way the parser is back in text."""
        self._where = _Where.TEXT
        if self._call is not None and self._call.index is not None:
            logger.debug("Qwen3-Coder tool call %r broken; ended at %r", self._call.name,
                         self._buf[:80])
            self._close_arguments(out)
            return
        logger.debug("Qwen3-Coder tool call markup broken; returned as text: %r",
                     START + self._raw + self._buf[:80])
        self._call = None
        self._buf = self._raw + self._buf
        self._raw = ""
        self._text(START, out)

    def _consume(self, length: int) -> None:
        """Drop decided markup; an uncommitted call keeps it to give it back as text."""
        if self._call is None or self._call.index is None:
            self._raw += self._buf[:length]
        self._buf = self._buf[length:]

    def _commit(self, out: StreamDelta) -> None:
        """Send the call's first piece (id and name) unless it is sent already."""
        call = self._call
        assert call is not None
        if call.index is not None:
            return
        call.index = self._num_calls
        self._num_calls += 1
        self._raw = ""
        self._spacing.call_emitted()
        out.tool_calls.append(ToolCallDelta(index=call.index, id=new_call_id(), name=call.name))

    def _add_parameter(self, name: str, value: str, out: StreamDelta) -> None:
        call = self._call
        assert call is not None
        if name in call.keys:  # the first value sent stands: a sent piece cannot be undone
            logger.debug("Qwen3-Coder tool call %r repeats parameter %r; ignored", call.name, name)
            return
        typed = convert_value(value, call.parameters.get(name))
        separator = ", " if call.keys else "{"
        call.keys.add(name)
        self._arguments(
            f"{separator}{json.dumps(name, ensure_ascii=False)}: "
            f"{json.dumps(typed, ensure_ascii=False)}",
            out,
        )

    def _close_arguments(self, out: StreamDelta) -> None:
        call = self._call
        assert call is not None
        self._arguments("}" if call.keys else "{}", out)
        self._call = None

    def _arguments(self, fragment: str, out: StreamDelta) -> None:
        """Append an arguments fragment, to the call's last piece when it is in this delta."""
        call = self._call
        assert call is not None and call.index is not None
        if out.tool_calls and out.tool_calls[-1].index == call.index:
            out.tool_calls[-1].arguments += fragment
        else:
            out.tool_calls.append(ToolCallDelta(index=call.index, arguments=fragment))

    def _text(self, text: str, out: StreamDelta) -> None:
        """Text outside calls (see ContentSpacing for its whitespace)."""
        self._spacing.text(text, out)
