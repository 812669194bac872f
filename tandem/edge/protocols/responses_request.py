"""A Responses API request (`POST /v1/responses`) read into the internal chat form.

What is translated:

- `input`: a string (one user message) or a list of items: messages (`type: "message"`, or
  the short form `{"role", "content"}`) with string content or `input_text` / `output_text` /
  `refusal` parts; `function_call` items (consecutive ones, and one right after an assistant
  message, become one assistant message with `tool_calls`, as the model wrote them);
  `function_call_output` items (tool messages). Image, file and audio parts are refused: the
  models tandem serves read text. `reasoning` items and items only a hosted runtime has
  (`web_search_call`, `item_reference`, ...) are dropped and named in `dropped`.
- `instructions`: a system message first (OpenAI does not carry a previous response's
  instructions over to the next one, so neither does the store).
- `tools`: `function` tools become chat functions; a `namespace` tool (Codex groups its MCP
  servers' tools so) is flattened into its functions, each named `namespace + name` (with
  `__` between them unless the namespace already ends in `_`), and a call of the flat name
  goes back to the client as `{"name", "namespace"}`, which is how Codex looks a tool up.
  Hosted tools (`web_search`, `file_search`, `code_interpreter`, `local_shell`, `custom`, ...)
  cannot run here: they are dropped and named in `dropped`, never refused, because Codex
  sends `web_search` with every request and gives up after five refusals.
- `tool_choice`, `parallel_tool_calls`, `max_output_tokens` (→ `max_tokens`), `temperature`,
  `top_p`, `stream`, `user`, and `text.format` (`text`, or `json_object` / `json_schema`, which
  become the chat request's `response_format`: generated under the schema). Everything else the API
  defines (`reasoning`, `include`, `store`, `service_tier`, `metadata`, `truncation`,
  `prompt_cache_key`, `safety_identifier`, ...) is accepted and has no effect on generation.

Every refusal is an `APIError` (400) naming the field, `param` in the Responses request's
own terms (`input[2].content[0]`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.edge.errors import APIError
from tandem.edge.protocols.base import CHAT_EXTRAS

_MESSAGE_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
_MEDIA_PARTS = ("input_image", "input_file", "input_audio", "image_url", "image", "file")
# A reasoning item with `reasoning_text` parts (what tandem's replies hold) goes back to the
# model as the next assistant turn's reasoning; one with only a summary or encrypted content
# carries nothing a chat template renders: dropped with a note.
_REASONING = "reasoning"
# Sampling extras passed through as the chat path takes them (vLLM's, through extra_body).
# tandem's extras (base.CHAT_EXTRAS: ignore_eos, cache_salt, ...) and the chat fields the
# Responses API lacks, taken as the chat request validates them.
_PASSED_THROUGH = (*CHAT_EXTRAS, "top_k", "presence_penalty", "frequency_penalty", "stop")
_TOOL_CHOICE_MODES = ("auto", "none", "required")


def bad(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def flat_name(namespace: str | None, name: str) -> str:
    """The chat function name of a tool `name` in `namespace` (Codex's MCP namespaces end in
    `__`, so theirs read `mcp__server__tool`, as Codex itself prints them)."""
    if not namespace:
        return name
    return f"{namespace}{name}" if namespace.endswith("_") else f"{namespace}__{name}"


@dataclass
class ToolSet:
    """The request's tools in chat form, and how to name a called function back."""

    chat: list[dict[str, Any]] = field(default_factory=list)
    # flat chat name -> (namespace, name) for functions that came out of a namespace
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.chat}

    def called(self, chat_name: str) -> tuple[str, str | None]:
        """(name, namespace) of a function the model called by its chat name."""
        found = self.namespaces.get(chat_name)
        return (found[1], found[0]) if found else (chat_name, None)


# --- input ---------------------------------------------------------------------------


def normalize_input(value: Any, dropped: list[str]) -> list[dict[str, Any]]:
    """The request's `input` as a list of normalized items (the form the store keeps):
    `{"type": "message", "role", "content": str}`, `{"type": "function_call", "call_id",
    "name", "arguments", "namespace"?}`, `{"type": "function_call_output", "call_id",
    "output": str}`. Dropped item types are named in `dropped`."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad("'input' must be a string or a list of input items", "input")
    items: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise bad(f"'{where}' must be an object", where)
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = "message"
        if kind == "message":
            items.append(_message(item, where))
        elif kind == "function_call":
            items.append(_function_call(item, where))
        elif kind == "function_call_output":
            items.append(_function_call_output(item, where))
        elif kind == _REASONING and (reasoning := _reasoning(item, where)) is not None:
            items.append(reasoning)
        elif isinstance(kind, str):
            _note(dropped, "reasoning items" if kind == _REASONING else f"input items of type {kind[:40]}")
        else:
            raise bad(f"'{where}.type' must be a string naming the item's type", f"{where}.type")
    return items


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise bad(f"'{where}.role' must be one of {', '.join(_MESSAGE_ROLES)}", f"{where}.role")
    return {"type": "message", "role": role, "content": content_text(item.get("content"), f"{where}.content")}


def content_text(content: Any, where: str) -> str:
    """A message's or a tool output's content as one string: text parts joined by newlines
    (as the chat path joins text parts); anything but text is refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"'{where}' must be a string or a list of content parts", where)
    texts = []
    for index, part in enumerate(content):
        at = f"{where}[{index}]"
        if not isinstance(part, dict):
            raise bad(f"'{at}' must be an object", at)
        kind = part.get("type")
        if kind in _TEXT_PARTS or kind == "refusal":
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise bad(f"'{at}.{'refusal' if kind == 'refusal' else 'text'}' must be a string", at)
            texts.append(text)
        elif kind in _MEDIA_PARTS:
            raise bad(f"content parts of type {kind!r} are not supported: this model reads text only",
                      at, "unsupported")
        else:
            raise bad(f"'{at}.type' must be input_text or output_text, got {str(kind)[:50]!r}", f"{at}.type")
    return "\n".join(texts)


def _string(item: Mapping[str, Any], key: str, where: str, required: bool = True) -> str | None:
    value = item.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value):
        raise bad(f"'{where}.{key}' must be a non-empty string", f"{where}.{key}")
    return value


def _reasoning(item: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    """A reasoning item's text parts, normalized as `{"type": "reasoning", "text": str}`; None
    when it has none."""
    content = item.get("content")
    if not isinstance(content, list):
        return None
    texts = []
    for index, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "reasoning_text":
            text = part.get("text")
            if not isinstance(text, str):
                raise bad(f"'{where}.content[{index}].text' must be a string", f"{where}.content[{index}].text")
            texts.append(text)
    return {"type": _REASONING, "text": "\n".join(texts)} if texts else None


def _function_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    arguments = item.get("arguments", "")
    if isinstance(arguments, dict):  # an object where a JSON string belongs: taken as meant
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise bad(f"'{where}.arguments' must be a JSON string", f"{where}.arguments")
    out = {"type": "function_call", "call_id": _string(item, "call_id", where),
           "name": _string(item, "name", where), "arguments": arguments}
    namespace = _string(item, "namespace", where, required=False)
    if namespace:
        out["namespace"] = namespace
    return out


def _function_call_output(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    output = item.get("output")
    if isinstance(output, (str, list)):
        text = content_text(output, f"{where}.output")
    elif output is None:
        raise bad(f"'{where}.output' is required: the tool's result", f"{where}.output")
    else:  # a JSON value where a string belongs: the model reads it as JSON
        text = json.dumps(output, ensure_ascii=False)
    return {"type": "function_call_output", "call_id": _string(item, "call_id", where), "output": text}


def to_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for normalized items (a stored conversation's, then the request's). An
    item that is not one of those forms (a store written by something else) is skipped."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn it opens
    for item in items:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == _REASONING:
            text = item.get("text") if isinstance(item.get("text"), str) else _reasoning_text(item.get("content"))
            reasoning = text or reasoning
            continue
        if kind == "message" and item.get("role") in _MESSAGE_ROLES:
            messages.append({"role": item["role"], "content": _text_of(item.get("content"))})
        elif kind == "function_call" and _strings(item, "call_id", "name"):
            namespace = item.get("namespace") if isinstance(item.get("namespace"), str) else None
            arguments = item.get("arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": flat_name(namespace, item["name"]),
                                 "arguments": arguments if isinstance(arguments, str) else ""}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # one turn's text and calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output" and _strings(item, "call_id"):
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(item.get("output"))})
        else:
            continue
        if reasoning is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = reasoning
            reasoning = None
    return messages


def _reasoning_text(content: Any) -> str:
    """A stored reasoning output item's `reasoning_text` parts."""
    if not isinstance(content, list):
        return ""
    return "\n".join(p["text"] for p in content
                     if isinstance(p, dict) and p.get("type") == "reasoning_text" and isinstance(p.get("text"), str))


def _strings(item: Mapping[str, Any], *keys: str) -> bool:
    return all(isinstance(item.get(key), str) and item[key] for key in keys)


def _text_of(content: Any) -> str:
    """Normalized content (a string) or an output message's parts (stored output items)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text") or p.get("refusal") or "") for p in content if isinstance(p, dict))
    return ""


# --- tools -----------------------------------------------------------------------------


def translate_tools(value: Any, dropped: list[str]) -> ToolSet:
    """The request's `tools`: functions (namespaces flattened) as chat tools; others dropped."""
    tools = ToolSet()
    if value is None:
        return tools
    if not isinstance(value, list):
        raise bad("'tools' must be a list", "tools")
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise bad(f"'{where}' must be an object with a 'type'", where)
        kind = tool["type"]
        if kind == "function":
            _add_function(tools, tool, where, None, dropped)
        elif kind == "namespace":
            namespace = _string(tool, "name", where)
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise bad(f"'{where}.tools' must be a list of tools", f"{where}.tools")
            for position, function in enumerate(inner):
                at = f"{where}.tools[{position}]"
                if not isinstance(function, dict):
                    raise bad(f"'{at}' must be an object", at)
                if function.get("type", "function") == "function":
                    _add_function(tools, function, at, namespace, dropped)
                else:
                    _note(dropped, f"tool {str(function.get('type'))[:40]} in namespace {namespace[:60]}")
        else:
            _note(dropped, f"tool {kind[:40]}")
    return tools


def _add_function(tools: ToolSet, tool: Mapping[str, Any], where: str, namespace: str | None,
                  dropped: list[str]) -> None:
    """One function as a chat tool: name, description, parameters. `strict` is left out: with
    no constrained decoding it changes nothing but the prompt (Codex sends it on every tool)."""
    name = _string(tool, "name", where)
    assert name is not None
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad(f"'{where}.parameters' must be a JSON schema object", f"{where}.parameters")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise bad(f"'{where}.description' must be a string", f"{where}.description")
    chat_name = flat_name(namespace, name)
    if chat_name in tools.names:
        _note(dropped, f"duplicate function {chat_name[:80]}")
        return
    function: dict[str, Any] = {"name": chat_name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    tools.chat.append({"type": "function", "function": function})
    if namespace:
        tools.namespaces[chat_name] = (namespace, name)


def _note(dropped: list[str], note: str) -> None:
    """Add a note once. Notes name what the client sent and go out in a response header, so
    only printable ASCII stays in them (a newline or an emoji there cannot be sent at all)."""
    note = "".join(c if " " <= c <= "~" else "?" for c in note)
    if note not in dropped:
        dropped.append(note)


def translate_tool_choice(value: Any, tools: ToolSet, dropped: list[str]) -> Any:
    """The chat `tool_choice` (None: the default); `allowed_tools` narrows `tools` in place."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in _TOOL_CHOICE_MODES:
            raise bad("'tool_choice' must be auto, none, required or a tool", "tool_choice")
        return value
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad("'tool_choice' must be auto, none, required or an object with a 'type'", "tool_choice")
    kind = value["type"]
    if kind == "function":
        name = _string(value, "name", "tool_choice")
        assert name is not None
        namespace = value.get("namespace")
        chat_name = flat_name(namespace if isinstance(namespace, str) else None, name)
        if chat_name not in tools.names:
            raise bad(f"'tool_choice' names the function {name[:80]!r}, which is not among 'tools'",
                      "tool_choice.name")
        return {"type": "function", "function": {"name": chat_name}}
    if kind == "allowed_tools":
        mode = value.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise bad("'tool_choice.mode' must be auto or required", "tool_choice.mode")
        allowed = value.get("tools")
        if not isinstance(allowed, list):
            raise bad("'tool_choice.tools' must be a list of tools", "tool_choice.tools")
        names = {flat_name(t.get("namespace") if isinstance(t.get("namespace"), str) else None, t["name"])
                 for t in allowed if isinstance(t, dict) and isinstance(t.get("name"), str)}
        tools.chat[:] = [t for t in tools.chat if t["function"]["name"] in names]
        return mode
    # A hosted tool forced (web_search, file_search, mcp, custom ...): it is not here to call.
    _note(dropped, f"tool_choice {kind[:40]}")
    return "auto"


# --- the rest ---------------------------------------------------------------------------


def text_format(value: Any) -> dict[str, Any] | None:
    """`text.format` as the chat request's `response_format` (None: plain text). Responses
    writes a JSON schema format flat (`{"type": "json_schema", "name", "schema", "strict"}`);
    chat nests it under `json_schema`. `verbosity` says nothing here."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("'text' must be an object", "text")
    fmt = value.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict | bool):
            raise bad("'text.format.schema' must be a JSON schema object", "text.format.schema")
        nested = {"name": str(fmt.get("name") or "response")[:64], "schema": schema}
        if isinstance(fmt.get("strict"), bool):
            nested["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": nested}
    raise bad("'text.format.type' must be text, json_object or json_schema", "text.format.type")


def max_output_tokens(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**31 - 1:
        raise bad("'max_output_tokens' must be a positive integer", "max_output_tokens")
    return value


def optional_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{key}' must be true or false", key)
    return value


def optional_string(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad(f"'{key}' must be a string", key)
    return value


def passed_through(body: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's sampling extras, as the chat path validates them."""
    return {key: body[key] for key in _PASSED_THROUGH if body.get(key) is not None}
