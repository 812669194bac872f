"""The interface between the OpenAI server and a model's tool-call text format.

Models do not return structured tool calls: they write them as text in a format their chat
template taught them (`<tool_call>{...}</tool_call>` for Hermes / Qwen, a bare JSON object for
Llama 3.1). A `ToolParser` knows one such format in both directions: it turns generated text
back into OpenAI `tool_calls`, and it writes tool definitions, earlier calls and tool results
as text for chat templates that have no tool support of their own.

Contract with the server
------------------------

Prompt. If the model's chat template does not use the `tools` variable, the server puts
`parser.system_prompt(tools, system=<existing system text>)` in the system message, renders
each assistant message that has `tool_calls` as `parser.render_assistant(content, calls)`,
and each `tool` message as a *user* message `parser.render_tool_result(content, name)`.

Forcing. For `tool_choice="required"` (`name=None`) or a named function, the server appends
`prefix = parser.forced_prefix(name)` to the rendered prompt (after the generation prompt), so
the model continues *inside* a call. The model never writes the prefix itself, so the parser
must see it before the generated text:

- non-streaming: `parser.parse(prefix + generated)`;
- streaming: `sp = parser.stream(prefix)` (same as `sp = parser.stream(); sp.feed(prefix)`),
  then `sp.feed(delta)` for each generated delta and `sp.finish()` at the end.

Feeding a forced prefix never emits anything: the prefix only opens a call, and nothing of a
call is emitted before the model has written some of it (most parsers emit a call whole when
it is complete; `qwen3_coder` streams it from the start of its body). Without forcing the
prefix is "" and nothing changes.

Streaming guarantees (checked by the tests for every way of splitting the text):

- the concatenation of every emitted `content` equals `parse(full).content` (`""` for `None`);
- for each call, the `arguments` fragments concatenate to exactly `parse(full)`'s `arguments`,
  and `id` / `name` are set on the first piece of a call only;
- text that might still turn out to be the start of a call (`"<tool"`) is held back until
  it can be decided, so no tool-call markup ever leaks into `content`.

`called_tools` tells the server to answer `finish_reason="tool_calls"`.

Malformed calls (bad JSON, no name) are returned as content, never raised: the client then
sees what the model wrote instead of a 500. A parser that streams a call before it is
complete cannot take its pieces back: markup that breaks after them ends the call there, and
the rest is content (see `qwen3_coder`).
"""

from __future__ import annotations

import contextlib
import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

# OpenAI ids look like "call_" + 24 alphanumerics; clients only need them unique per response.
_CALL_ID_BYTES = 12


def new_call_id() -> str:
    """A fresh OpenAI-style call id; random so ids from concurrent responses never collide."""
    return "call_" + secrets.token_hex(_CALL_ID_BYTES)


@dataclass
class ToolCall:
    """One complete call, as OpenAI's `message.tool_calls[i]` carries it."""

    id: str
    name: str
    arguments: str  # a JSON object, as text: OpenAI sends arguments as a string

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedMessage:
    """A whole response split into what the user reads and what the client must execute."""

    content: str | None  # None rather than "" or whitespace, as OpenAI does beside tool calls
    tool_calls: list[ToolCall]

    @classmethod
    def from_deltas(cls, deltas: Iterable[StreamDelta]) -> ParsedMessage:
        """Reassemble a stream the way a client does, so stream and non-stream share one path."""
        text: list[str] = []
        calls: dict[int, ToolCall] = {}
        for delta in deltas:
            text.append(delta.content)
            for piece in delta.tool_calls:
                call = calls.get(piece.index)
                if call is None:
                    calls[piece.index] = ToolCall(
                        id=piece.id or "", name=piece.name or "", arguments=piece.arguments
                    )
                else:
                    call.arguments += piece.arguments
        content = "".join(text)
        return cls(
            content=content if content.strip() else None,
            tool_calls=[calls[i] for i in sorted(calls)],
        )


@dataclass
class ToolCallDelta:
    """One streamed piece of a call; mirrors OpenAI's `delta.tool_calls[i]`."""

    index: int
    id: str | None = None  # only on the first piece of a call
    name: str | None = None  # only on the first piece of a call
    arguments: str = ""  # a fragment of the arguments JSON text

    def to_openai(self) -> dict[str, Any]:
        """The chunk dict; keys a client must not see twice are left out, not sent as null."""
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


@dataclass
class StreamDelta:
    """What one `feed` / `finish` call lets the server send now."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        """False when there is nothing to send, so the server can skip an empty chunk."""
        return bool(self.content or self.tool_calls)

    def extend(self, other: StreamDelta) -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


class ToolStreamParser(ABC):
    """Per-response state for streaming; see the module docstring for the guarantees."""

    @abstractmethod
    def feed(self, text_delta: str) -> StreamDelta:
        """Take newly generated text; return what can be emitted without risk of retraction."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """End of generation: flush held text; an unterminated or invalid call becomes
        content unless it still parses as a complete call."""

    @property
    @abstractmethod
    def called_tools(self) -> bool:
        """True once at least one valid call was emitted."""


# (rule name, a tool's parameters schema) -> Lark rules, the first defining `rule name`: how
# a format writes one call's arguments, for a format whose arguments are not one JSON object.
ArgumentRules = Callable[[str, Mapping[str, Any]], list[str]]


@dataclass(frozen=True)
class CallShape:
    """A call format as text around each call's arguments. A section holds one or more calls:
    `section_begin`, the calls joined by `separator`, `section_end`. One call of `name` is
    `before(name)`, its arguments, `after(name)`. The arguments are JSON under the tool's
    schema unless `arguments` writes their rules (Qwen3-Coder's XML parameters). `call_index`
    marks where a format writes the call's number (Kimi-K2's `functions.NAME:IDX`): any
    digits there."""

    section_begin: str
    separator: str
    section_end: str
    before: Callable[[str], str]
    after: Callable[[str], str]
    call_index: str = ""  # a placeholder inside before(name) that stands for digits
    arguments: ArgumentRules | None = None
    # The parser also reads a reply made only of calls written without the section's markers
    # (Hermes: bare `{"name": ..., "arguments": ...}` objects, or one ```json fence of them).
    bare: bool = False


class ToolParser(ABC):
    """One tool-call text format, both directions. Stateless: share one per server."""

    name: ClassVar[str]
    # Markers of the format that a tokenizer may hold as special tokens: the server keeps
    # their text in the output it parses (a detokenizer skipping special tokens drops it).
    preserved_tokens: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def stream(self, prefix: str = "", tool_names: Collection[str] = ()) -> ToolStreamParser:
        """A fresh streaming parser for one response, already fed `prefix` (which, for a
        prefix from `forced_prefix`, emits nothing). `tool_names` are the request's declared
        functions: a parser may use them to accept calls that only a declared name makes
        unambiguous. The server passes a mapping from each name to its parameters' JSON
        schema, which a format that writes arguments as untyped text (Qwen3-Coder's XML)
        needs to give each value its type; any collection of names serves the others."""

    def parse(self, text: str, tool_names: Collection[str] = ()) -> ParsedMessage:
        """Parse a whole response. Defined through `stream` so the two can never disagree."""
        parser = self.stream(tool_names=tool_names)
        return ParsedMessage.from_deltas([parser.feed(text), parser.finish()])

    def call_shape(self) -> CallShape | None:
        """How this format writes calls, for a grammar that makes the model write only calls
        that parse and name a declared tool (tool_parsers/grammar.py); None: no grammar is
        written for this format, and its calls stay free."""
        return None

    @abstractmethod
    def forced_prefix(self, name: str | None) -> str:
        """Text that opens a call, appended to the prompt to force one: any function when
        `name` is None (tool_choice "required"), else that function."""

    def stop_strings(self, parallel_tool_calls: bool = True) -> list[str]:
        """Stop strings that save decoding past the first call when only one is wanted.

        The parser accepts output cut by them (an unterminated final call still parses), so
        the server may drop them from the output as usual. The server should still keep only
        the first call when `parallel_tool_calls` is false: a stop string is an optimisation.
        """
        del parallel_tool_calls
        return []

    @abstractmethod
    def system_prompt(self, tools: Sequence[Mapping[str, Any]], system: str | None = None) -> str:
        """System message text teaching the model the tools and this format, appended to the
        client's own `system` text when there is one."""

    @abstractmethod
    def render_tool_calls(self, calls: Sequence[ToolCall | Mapping[str, Any]]) -> str:
        """Earlier calls (`ToolCall`s or OpenAI `tool_calls` dicts) as the model writes them."""

    def render_assistant(
        self, content: str | None, calls: Sequence[ToolCall | Mapping[str, Any]]
    ) -> str:
        """A whole earlier assistant turn: its text, then its calls, as the model writes them."""
        rendered = self.render_tool_calls(calls)
        if not calls:
            return content or ""
        return f"{content}\n{rendered}" if content else rendered

    @abstractmethod
    def render_tool_result(self, content: str, name: str | None = None) -> str:
        """A tool's result, as the text of a user message."""


def call_from_json(obj: Any, args_keys: Sequence[str]) -> ToolCall | None:
    """A call from a decoded `{"name": ..., <args key>: ...}` object, or None if it is not one.

    Arguments may come as an object or as a JSON string holding an object (some models
    double-encode); anything else means the model did not write a call we can execute.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(id=new_call_id(), name=name, arguments=json.dumps(args, ensure_ascii=False))


def history_call(call: ToolCall | Mapping[str, Any]) -> tuple[str, Any]:
    """(name, arguments value) of an earlier call, from a `ToolCall` or an OpenAI dict.

    Arguments are decoded so they render as JSON rather than as a quoted string; text that
    is not JSON is kept as the string the client sent rather than rejected.
    """
    if isinstance(call, ToolCall):
        name, args = call.name, call.arguments
    else:
        function = call.get("function", call)
        name = str(function.get("name", ""))
        args = function.get("arguments", {})
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):
            args = json.loads(args) if args.strip() else {}
    return name, args


def object_arguments(text: str) -> str | None:
    """Arguments text as the JSON object a call carries (re-serialized), or None unless it is
    one; empty text is `{}`, as a function without parameters may be called with nothing."""
    text = text.strip()
    try:
        args = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


class ContentSpacing:
    """The content around calls, less the whitespace that only separates text from calls.

    A model writes "Let me check.\n\n<call>" and the client should not get the newlines:
    trailing whitespace of the text waits (`text`) until more text keeps it or a call drops
    it (`drop_pending`, `call_emitted`); whitespace after calls that no text preceded is
    dropped; at the end (`flush`) whitespace after text stays. Every rule looks only at text
    already seen, so how the output is split into deltas cannot change the result."""

    def __init__(self) -> None:
        self._pending = ""  # trailing whitespace of the text so far
        self._strip_next = False  # calls came first: whitespace before the next text is dropped
        self._seen_text = False

    def text(self, text: str, out: StreamDelta) -> None:
        if not text:
            return
        if self._strip_next:
            text = text.lstrip()
            if not text:
                return
            self._strip_next = False
        body = text.rstrip()
        if not body:
            self._pending += text
            return
        out.content += self._pending + body
        self._pending = text[len(body):]
        self._seen_text = True

    def raw(self, text: str, out: StreamDelta) -> None:
        """Text that is sent as it is (a call that did not parse, markers included)."""
        out.content += self._pending + text
        self._pending = ""
        self._seen_text = True

    def drop_pending(self) -> None:
        self._pending = ""

    def call_emitted(self) -> None:
        self._pending = ""
        # Text after the calls keeps its leading whitespace only if it continues earlier text.
        self._strip_next = not self._seen_text

    def flush(self, out: StreamDelta) -> None:
        if self._seen_text and self._pending:
            out.content += self._pending
        self._pending = ""


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`: text to hold
    back because the next delta may complete the marker."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
