"""Anthropic's Messages API (`POST /v1/messages`, what Claude Code speaks) as a chat request.

The request (`MessagesAdapter.to_chat`):

- `system`, a string or text blocks → a system message; blocks become content parts, each
  keeping its `cache_control` breakpoint. **The billing header rule:** a system text block
  that starts with `x-anthropic-billing-header:` is metadata, not instructions (Claude Code
  sends its version and a per-request hash in it), so it is dropped from the prompt: kept,
  it would change the prompt's first tokens on every request and defeat the prefix cache.
- messages, with a string or blocks: `text` → text parts (`cache_control` kept); an
  assistant's `tool_use` → a chat `tool_calls` entry (same id, `input` as JSON arguments);
  a user's `tool_result` → a `tool` message with its `tool_call_id` (content a string or
  text blocks; `is_error` says "Error:" first); an assistant's `thinking` blocks → its
  `reasoning_content` (a thinking model's template renders it for the tool-call rounds of
  the turn in progress), `redacted_thinking` dropped; `image` / `document` are a 400 (the model reads text only), as is any other
  block type. A final assistant message is continued (Anthropic's prefill).
- `tools` → function tools (`input_schema` → `parameters`); tools of other types
  (Anthropic's server tools: `web_search_20250305`, `bash_20250124`, ...) are dropped and
  named in `Translated.dropped`. `tool_choice` auto / any / tool / none → auto / required /
  the named function / none; `disable_parallel_tool_use` → `parallel_tool_calls: false`;
  a tool's `strict` passes through (its calls generated under its schema).
- Structured outputs: `output_format` (or `output_config.format`) `json_schema` → the chat
  request's `response_format`, so the reply's text validates against the schema.
- `stop_sequences` → `stop`; `temperature`, `top_p`, `top_k`, `max_tokens` (required, as
  Anthropic requires it) and `stream` as they are; a stream asks for the final usage chunk.
- Unknown fields and betas (`?beta=true`, `anthropic-beta`, `context_management`,
  `service_tier`, ...) are ignored, each logged once per adapter. A top-level
  `cache_control` puts its breakpoint on the last message's last block, as Anthropic's does.
- The session (the router's affinity): the `X-Claude-Code-Session-Id` header, else the
  `session_id` inside `metadata.user_id` (a JSON string; one that is not JSON is the session).
- `thinking`: a model without a reasoning format ignores it; with it requested, output that
  starts with `<think>` comes back as a `thinking` block (anthropic_reply.py).

The reply, stream and errors are anthropic_reply.py's and anthropic_stream.py's.
`count_chat` translates a `/v1/messages/count_tokens` body the same way (without
`max_tokens`), for the prompt's token count.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.edge.errors import bad_request
from tandem.edge.protocols import anthropic_reply
from tandem.edge.protocols.anthropic_models import (
    KNOWN_FIELDS,
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolDefinition,
    ToolResultBlock,
    ToolUseBlock,
    block_type,
    text_only,
    unknown_block,
    validated,
)
from tandem.edge.protocols.anthropic_stream import MessagesStream
from tandem.edge.protocols.base import (
    ProtocolAdapter,
    StreamTranslator,
    Translated,
    chat_extras,
)

logger = logging.getLogger(__name__)

BILLING_HEADER = "x-anthropic-billing-header:"
SESSION_HEADER = "x-claude-code-session-id"
_MAX_SESSION = 256
_TEXT_ONLY = ("image", "document")
_DROPPED_BLOCKS = ("redacted_thinking",)


@dataclass
class MessagesTranslated(Translated):
    """What the reply needs besides the chat request: whether thinking was asked for."""

    thinking: bool = False


class MessagesAdapter(ProtocolAdapter):
    name = "messages"

    def __init__(self) -> None:
        self._logged: set[str] = set()  # fields and betas already logged as ignored

    # --- requests -------------------------------------------------------------------
    async def to_chat(self, body: dict[str, Any], headers: Mapping[str, str], caller: str = "") -> MessagesTranslated:
        request = validated(MessagesRequest, body)
        self._log_ignored(body, headers)
        translated = self._translate(request, headers)
        chat = translated.chat
        chat["max_tokens"] = request.max_tokens
        chat["stream"] = request.stream
        if request.stream:
            chat["stream_options"] = {"include_usage": True}
        if request.stop_sequences:
            chat["stop"] = list(request.stop_sequences)
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(request, name)
            if value is not None:
                chat[name] = value
        output = request.output_format or (request.output_config.format if request.output_config else None)
        if output is not None:
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": output.schema_}}
        chat.update(chat_extras(body))
        return translated

    async def count_chat(self, body: dict[str, Any], headers: Mapping[str, str]) -> MessagesTranslated:
        """A `/v1/messages/count_tokens` body: the chat request whose prompt is to be counted."""
        request = validated(CountTokensRequest, body)
        self._log_ignored(body, headers)
        return self._translate(request, headers)

    def _translate(self, request: CountTokensRequest, headers: Mapping[str, str]) -> MessagesTranslated:
        messages = _system(request.system)
        for i, message in enumerate(request.messages):
            messages += _message(message.role, message.content, i)
        if request.cache_control is not None and messages:
            _mark_last(messages[-1], request.cache_control.model_dump(exclude_none=True))
        chat: dict[str, Any] = {"model": request.model, "messages": messages}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
            chat["add_generation_prompt"] = False  # Anthropic's prefill: the reply continues it
            chat["continue_final_message"] = True
        tools, dropped = _tools(request.tools)
        if tools:
            chat["tools"] = tools
            _tool_choice(chat, request.tool_choice)
        elif request.tool_choice is not None and request.tool_choice.type in ("any", "tool"):
            raise bad_request(f"tool_choice {request.tool_choice.type!r} needs at least one client tool "
                              "in 'tools'", "tool_choice", "invalid_value")
        thinking = request.thinking is not None and request.thinking.type != "disabled"
        session = _session(headers, getattr(request, "metadata", None))
        return MessagesTranslated(chat, session, dropped, thinking)

    def _log_ignored(self, body: dict[str, Any], headers: Mapping[str, str]) -> None:
        names = [f"field {k!r}" for k in body if k not in KNOWN_FIELDS]
        betas = _header(headers, "anthropic-beta") or ""
        names += [f"beta {b.strip()!r}" for b in betas.split(",") if b.strip()]
        for name in names[:64]:
            if name not in self._logged and len(self._logged) < 1024:
                self._logged.add(name)
                logger.info("/v1/messages: ignoring %s (this server has no use for it)", name[:200])

    # --- responses ------------------------------------------------------------------
    async def reply(self, chat_reply: dict[str, Any], translated: Translated) -> dict[str, Any]:
        return anthropic_reply.message_reply(chat_reply, _thinking(translated), _stops(translated))

    def stream(self, translated: Translated) -> StreamTranslator:
        model = translated.chat.get("model")
        return MessagesStream(model if isinstance(model, str) else None, _thinking(translated),
                              _stops(translated))

    def reply_id(self, translated: Translated, chat_id: str) -> str:
        return anthropic_reply.message_id(chat_id)

    def error_body(self, status: int, openai_body: dict[str, Any]) -> dict[str, Any]:
        return anthropic_reply.error_body(status, openai_body)


def _thinking(translated: Translated) -> bool:
    return isinstance(translated, MessagesTranslated) and translated.thinking


def _stops(translated: Translated) -> list[str]:
    stop = translated.chat.get("stop")
    return [s for s in stop if isinstance(s, str)] if isinstance(stop, list) else []


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:  # a plain dict (tests, callers other than Starlette's Headers)
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    return value


def _session(headers: Mapping[str, str], metadata: Any) -> str | None:
    """Claude Code's session: its header, else `session_id` in `metadata.user_id`'s JSON."""
    session = _header(headers, SESSION_HEADER)
    if not session and metadata is not None and metadata.user_id:
        session = metadata.user_id
        try:
            parsed = json.loads(metadata.user_id)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str) and parsed["session_id"]:
            session = parsed["session_id"]
    session = (session or "").strip()[:_MAX_SESSION]
    return session or None


def _part(block: TextBlock) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "text", "text": block.text}
    if block.cache_control is not None:
        part["cache_control"] = block.cache_control.model_dump(exclude_none=True)
    return part


def _system(system: str | list[Any] | None) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    parts = []
    for j, raw in enumerate(system):
        loc = ("system", j)
        kind = block_type(raw, loc)
        if kind != "text":
            raise unknown_block(kind, loc, "text")
        block = validated(TextBlock, raw, loc)
        if block.text.lstrip().startswith(BILLING_HEADER):
            continue  # metadata, not instructions: see the module docstring
        parts.append(_part(block))
    return [{"role": "system", "content": parts}] if parts else []


def _message(role: str, content: str | list[Any], i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (a user's tool results become `tool` messages)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    breakpoint_: dict[str, Any] | None = None
    reasoning: list[str] = []
    for j, raw in enumerate(content):
        loc = ("messages", i, "content", j)
        kind = block_type(raw, loc)
        if kind == "text":
            parts.append(_part(validated(TextBlock, raw, loc)))
        elif kind in _DROPPED_BLOCKS or (kind == "thinking" and role != "assistant"):
            continue
        elif kind == "thinking":
            reasoning.append(validated(ThinkingBlock, raw, loc).thinking)
        elif kind in _TEXT_ONLY:
            raise text_only(kind, loc)
        elif kind == "tool_use" and role == "assistant":
            use = validated(ToolUseBlock, raw, loc)
            arguments = json.dumps(use.input, ensure_ascii=False)
            calls.append({"id": use.id, "type": "function", "function": {"name": use.name, "arguments": arguments}})
            if use.cache_control is not None:
                breakpoint_ = use.cache_control.model_dump(exclude_none=True)
        elif kind == "tool_result" and role == "user":
            if parts:  # text before the result stays before it
                out.append({"role": "user", "content": parts})
                parts = []
            out.append(_tool_result(validated(ToolResultBlock, raw, loc), loc))
        else:
            allowed = {"assistant": "text, tool_use, thinking", "user": "text, tool_result"}.get(role, "text")
            raise unknown_block(kind, loc, allowed)
    if breakpoint_ is not None:  # a breakpoint on a call marks the message it is part of
        if parts:
            parts[-1]["cache_control"] = breakpoint_
        else:
            parts.append({"type": "text", "text": "", "cache_control": breakpoint_})
    if calls:
        out.append({"role": "assistant", "content": parts or None, "tool_calls": calls})
    elif parts:
        out.append({"role": role, "content": parts})
    if reasoning and out:
        out[-1]["reasoning_content"] = "\n".join(reasoning)
    return out


def _mark_last(message: dict[str, Any], cache_control: dict[str, Any]) -> None:
    """A breakpoint on the message's last part (its string content made the one part)."""
    content = message.get("content")
    if isinstance(content, list) and content:
        content[-1]["cache_control"] = cache_control
    else:
        message["content"] = [{"type": "text", "text": content or "", "cache_control": cache_control}]


def _tool_result(block: ToolResultBlock, loc: tuple[Any, ...]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    if isinstance(block.content, str):
        parts.append({"type": "text", "text": block.content})
    for j, raw in enumerate(block.content if isinstance(block.content, list) else []):
        inner = (*loc, "content", j)
        kind = block_type(raw, inner)
        if kind in _TEXT_ONLY:
            raise text_only(kind, inner)
        if kind != "text":
            raise unknown_block(kind, inner, "text")
        parts.append(_part(validated(TextBlock, raw, inner)))
    if block.is_error:
        parts.insert(0, {"type": "text", "text": "Error:"})
    if block.cache_control is not None:
        if not parts:
            parts.append({"type": "text", "text": ""})
        parts[-1]["cache_control"] = block.cache_control.model_dump(exclude_none=True)
    content: str | list[dict[str, Any]] = parts
    if not any("cache_control" in p for p in parts):
        content = "\n".join(p["text"] for p in parts)
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _tools(tools: list[Any] | None) -> tuple[list[dict[str, Any]], list[str]]:
    """Client tools as chat function tools; the others (server tools) by name, dropped."""
    functions: list[dict[str, Any]] = []
    dropped: list[str] = []
    for j, raw in enumerate(tools or []):
        loc = ("tools", j)
        if not isinstance(raw, dict):
            raise bad_request(f"'tools.{j}' must be a tool object", f"tools.{j}", "invalid_value")
        kind = raw.get("type")
        if kind not in (None, "custom"):
            dropped.append(f"tool {str(kind)[:100]}")
            continue
        tool = validated(ToolDefinition, raw, loc)
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.strict is not None:
            function["strict"] = tool.strict
        functions.append({"type": "function", "function": function})
    return functions, dropped


def _tool_choice(chat: dict[str, Any], choice: ToolChoice | None) -> None:
    if choice is None:
        return
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type 'tool' needs the tool's 'name'", "tool_choice.name",
                              "invalid_value")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        chat["parallel_tool_calls"] = False
