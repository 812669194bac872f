"""Chat templates rendered with jinja2 exactly as transformers renders them, without transformers.

A model's chat template is jinja2 code from the model's files: untrusted, so it runs in jinja2's
immutable sandbox. The environment matches transformers' (`trim_blocks`, `lstrip_blocks`, the
`loopcontrols` extension, a `{% generation %}` block, a `tojson` filter that does not escape
HTML and takes `indent` / `separators` / `sort_keys`, the `raise_exception` and `strftime_now`
globals, and guarded `dict` / `namespace`), and so do the variables a template sees: `messages`,
`tools`, `documents`, `add_generation_prompt`, the named special tokens (`bos_token`,
`eos_token`, ...) and any extra keyword arguments. Inputs are copied into plain JSON-like data
first, so a template never reaches a caller's live objects.

`continue_final_message` renders the conversation with a marker after the final message's
content and cuts the text there, so the model continues that message instead of starting one.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

# The fields a message's reasoning may come under; templates read the first, gpt-oss "thinking".
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the final message's text to find where it ends in the rendered prompt.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(TemplateError, ValueError):
    """A template refused the conversation (`raise_exception`): bad input, not a server fault.

    Both a jinja2 `TemplateError`, as transformers raises, and a `ValueError`, as callers that
    validate input expect.
    """


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks.

    Rendering only needs the body; without the tag such templates would not even parse.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` for templates, without handing them the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """jinja2's `namespace()` refusing underscore names, which lead to CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's trick: `self` may be a kwarg
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot set underscore attributes on a namespace: {name!r}")


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML, which would change prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def make_environment() -> ImmutableSandboxedEnvironment:
    """A sandbox configured as transformers configures it for chat templates."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def plain_data(value: Any) -> Any:
    """A copy of `value` built from JSON-like types only; anything else becomes "<TypeName>".

    Templates only test media entries for presence, so placeholders render the same, and the
    sandbox never sees an object whose methods it does not know to be harmless.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(key): plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_data(item) for item in value)
    numpy = sys.modules.get("numpy")  # a numpy scalar implies numpy is imported already
    if numpy is not None and isinstance(value, numpy.generic):
        return plain_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reasoning under any of its names is also given as `reasoning_content` and `thinking`."""
    out = []
    for message in messages:
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tool_schemas(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    schemas = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise ValueError(
                f"tools must be JSON schemas (dicts), got {type(tool).__name__}; "
                "converting Python functions into schemas is not supported"
            )
        schemas.append(tool)
    return plain_data(schemas)


class ChatTemplates:
    """A tokenizer's chat template(s) and their compiled forms (compiled once, per tokenizer)."""

    def __init__(self, templates: str | dict[str, str] | None) -> None:
        self.templates = templates
        self._env = make_environment()
        self._compiled: dict[str, jinja2.Template] = {}

    def select(self, chat_template: str | None = None, tools: Sequence[Any] | None = None) -> str:
        """The template text to use: a name among several templates, explicit text, or the default.

        With several named templates and none asked for, "tool_use" is taken when tools are
        given and there is one, else "default".
        """
        if isinstance(self.templates, dict):
            if chat_template is not None and chat_template in self.templates:
                return self.templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in self.templates:
                    return self.templates["tool_use"]
                if "default" in self.templates:
                    return self.templates["default"]
                raise ValueError(
                    "this model has several chat templates and none is the default; pass one of "
                    f"{sorted(self.templates)} as chat_template"
                )
            return chat_template
        if chat_template is not None:
            return chat_template
        if self.templates is None:
            raise ValueError("this model has no chat template (none in tokenizer_config.json or chat_template.jinja)")
        return self.templates

    def compile(self, text: str) -> jinja2.Template:
        compiled = self._compiled.get(text)
        if compiled is None:
            compiled = self._compiled[text] = self._env.from_string(text)
        return compiled

    def render(
        self,
        template: str,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        documents: Sequence[Any] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """One conversation rendered; `variables` are the special tokens and extra kwargs."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        compiled = self.compile(template)
        schemas = _tool_schemas(tools)
        if documents is not None and any(not isinstance(d, Mapping) for d in documents):
            raise TypeError("documents must be a list of dicts (with 'title' and 'text' keys)")
        chat = _plain_messages(messages)
        final_text: str | None = None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final_text = _tag_final_message(chat, field, template)
        rendered = compiled.render(
            messages=chat,
            tools=schemas,
            documents=plain_data(documents),
            add_generation_prompt=add_generation_prompt,
            **plain_data(dict(variables or {})),
        )
        if final_text is not None:
            rendered = _cut_after_final_message(rendered, final_text)
        return rendered


def _plain_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as plain dicts, keys whose value is None dropped (templates test presence)."""
    chat = []
    for message in messages:
        if isinstance(message, Mapping):
            message = {key: value for key, value in message.items() if value is not None}
        message = plain_data(message)
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        chat.append(message)
    return _with_reasoning_aliases(chat)


def _tag_final_message(chat: list[dict[str, Any]], field: str, template: str) -> str:
    """Append the marker to the final message's `field` (every copy of reasoning); return its text."""
    if not chat:
        raise ValueError("continue_final_message needs a non-empty conversation")
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message: the final message has no "{field}" to continue')
    fields = [field]
    if field in REASONING_FIELDS:
        fields = [name for name in REASONING_FIELDS if chat[-1].get(name) == final]
    if not any(name in template for name in fields):
        raise ValueError(f'continue_final_message: the chat template does not use the field "{field}"')
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
        raise ValueError("continue_final_message: the final message has no text block to continue")
    for name in fields:
        chat[-1][name] = chat[-1][name] + _CONTINUE_TAG
    return final


def _cut_after_final_message(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ValueError(
            "continue_final_message: the chat template changed the final message, so where it ends "
            f"cannot be found in the prompt. Final message: {final_text.strip()!r}"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    # The template trimmed the message's trailing whitespace (and so the tag's space).
    return rendered[:at].rstrip()
