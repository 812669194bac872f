"""Chat messages (+ tools) → the prompt text the model was trained on.

The model's own chat template renders the conversation. When it knows about tools (it uses
the `tools` variable, as Qwen's and Llama 3.1's do) it gets the tools and the tool history
as they are. When it does not (SmolLM2's), the tool parser's format is taught through the
system message and the tool history is written out in that format, so any chat model can
be asked for tool calls in a format we can parse back.

`tool_choice` "required" or a named function appends the opening of a call after the
generation prompt (the parser's `forced_prefix`): the model then continues inside a call.
This is a prefix, not a grammar; a model that then writes invalid JSON gets its text back
as content.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from tandem.edge.errors import bad_request
from tandem.edge.openai_protocol import ChatMessage, NamedToolChoice, Tool
from tandem.server.tool_parsers import ToolParser, template_supports_tools
from tandem.server.typescript_tools import UnrenderableSchema, tools_as_typescript

logger = logging.getLogger(__name__)


@dataclass
class ChatPrompt:
    text: str
    forced_prefix: str  # already part of `text`; the parser must see it before the output
    tools_enabled: bool
    # The declared functions when tools are enabled, each with its parameters' JSON schema
    # (a parser whose format writes arguments untyped reads their types there).
    tool_names: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def tool_choice_name(tool_choice: Any) -> str | None:
    return tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else None


def check_tool_choice(tools: list[Tool] | None, tool_choice: Any) -> None:
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if not tools:
        raise bad_request(f"tool_choice {_describe(tool_choice)} needs a non-empty 'tools' list",
                          "tool_choice", "invalid_value")
    name = tool_choice_name(tool_choice)
    if name is not None and name not in {t.function.name for t in tools}:
        raise bad_request(f"tool_choice names function '{name}', which is not in 'tools' "
                          f"({', '.join(t.function.name for t in tools)})", "tool_choice", "invalid_value")


def _describe(tool_choice: Any) -> str:
    name = tool_choice_name(tool_choice)
    return f"function '{name}'" if name else repr(tool_choice)


def render_chat_prompt(tokenizer: Any, messages: list[ChatMessage], tools: list[Tool] | None,
                       tool_choice: Any, parser: ToolParser, add_generation_prompt: bool = True,
                       continue_final_message: bool = False,
                       template_kwargs: Mapping[str, Any] | None = None,
                       prefix_forces_calls: bool = True) -> ChatPrompt:
    template = tokenizer.chat_template
    if template is None:
        raise bad_request("this model has no chat template; use /v1/completions", "messages", "no_chat_template")
    check_tool_choice(tools, tool_choice)
    tools_enabled = bool(tools) and tool_choice != "none"
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools_enabled and tools else None
    native = template_supports_tools(template)
    try:
        if native:
            verbatim = template_takes_string_arguments(template)
            conversation = [_native_message(m, verbatim) for m in messages]
        else:
            conversation = _rewrite_for_plain_template(messages, parser, tool_dicts)
            tool_dicts = None
    except ValueError as exc:
        raise bad_request(str(exc), "messages", "invalid_value") from exc
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message", "invalid_value")
    extra = dict(template_kwargs or {})
    if tool_dicts and _TOOLS_AS_TYPESCRIPT.search(template):
        try:
            extra["tools_ts_str"] = tools_as_typescript(tool_dicts)
        except UnrenderableSchema as exc:  # the template's JSON form instead
            logger.debug("tools declared as JSON, not TypeScript: %s", exc)
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=tool_dicts, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **extra,
        )
    except (TemplateError, ValueError, TypeError, KeyError) as exc:
        raise bad_request(f"the chat template could not render these messages: {exc}", "messages",
                          "template_error") from exc
    forced = ""
    if tools_enabled and tool_choice not in (None, "auto") and prefix_forces_calls:
        forced = parser.forced_prefix(tool_choice_name(tool_choice))
        text += forced
    names = {t.function.name: t.function.parameters or {} for t in tools or ()} if tools_enabled else {}
    return ChatPrompt(text, forced, tools_enabled, names)


# A template that reads `tools_ts_str` (Kimi K2.5's) declares the tools in TypeScript when given it.
_TOOLS_AS_TYPESCRIPT = re.compile(r"\btools_ts_str\b")
# `arguments is string` in a template: it writes a string as it is (Kimi K2.5's, Qwen3's).
_STRING_ARGUMENTS = re.compile(r"arguments\W{0,3}\s+is\s+string")


def template_takes_string_arguments(template: str) -> bool:
    """Whether the template writes a call's arguments string verbatim. Those templates get
    the exact text the model generated (and the client sent back): parsed and re-serialized
    by `tojson` it would differ in spacing and key order from what the model wrote, and the
    turn's prompt would part from the cached one at the first call."""
    return _STRING_ARGUMENTS.search(template) is not None


def _native_message(message: ChatMessage, verbatim_arguments: bool = False) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": message.text()}
    if message.name:
        out["name"] = message.name
    reasoning = message.reasoning_text()
    if role == "assistant" and reasoning is not None:
        out["reasoning_content"] = reasoning
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name,
                          "arguments": c.function.arguments if verbatim_arguments else _json_or_text(c.function.arguments)}}
            for c in message.tool_calls
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def _json_or_text(arguments: str) -> Any:
    """Templates render arguments with `tojson`; give them the object, not a quoted string."""
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return arguments


def _rewrite_for_plain_template(messages: list[ChatMessage], parser: ToolParser,
                                tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Tool definitions, calls and results written as text, for a template that knows none."""
    names_by_id = {c.id: c.function.name for m in messages for c in (m.tool_calls or []) if c.id}
    conversation: list[dict[str, Any]] = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        text = message.text()
        if role == "assistant" and message.tool_calls:
            calls = [{"function": {"name": c.function.name, "arguments": c.function.arguments}}
                     for c in message.tool_calls]
            conversation.append({"role": "assistant", "content": parser.render_assistant(text, calls)})
        elif role == "tool":
            name = message.name or names_by_id.get(message.tool_call_id or "")
            conversation.append({"role": "user", "content": parser.render_tool_result(text, name)})
        else:
            conversation.append({"role": role, "content": text})
    if tools:
        if conversation and conversation[0]["role"] == "system":
            conversation[0]["content"] = parser.system_prompt(tools, system=conversation[0]["content"])
        else:
            conversation.insert(0, {"role": "system", "content": parser.system_prompt(tools)})
    return conversation
