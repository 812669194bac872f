"""The Responses API's objects, built from what the chat path produced.

One builder for the whole reply and the stream's end, so that a streamed response's
`response.completed` is the very object the same generation answers whole: same ids (the
response's id is drawn when the request is read; item ids are the response's plus the item's
position), same items, same statuses, same usage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.edge.protocols.base import Translated
from tandem.edge.protocols.responses_request import ToolSet


@dataclass
class ResponsesTranslated(Translated):
    """A Responses request in the internal form, with what its answer echoes and stores."""

    response_id: str = ""
    created_at: int = 0
    model: str | None = None  # as requested (the reply names the model that answered)
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response repeats
    tools: ToolSet = field(default_factory=ToolSet)
    conversation: list[dict[str, Any]] = field(default_factory=list)  # stored + new input items
    store: bool = True
    owner: str = ""  # the caller it is stored for: only they can read or continue it

    @property
    def id_base(self) -> str:
        return self.response_id.removeprefix("resp_")

    def message_id(self, index: int) -> str:
        return f"msg_{self.id_base}_{index}"

    def call_item_id(self, index: int) -> str:
        return f"fc_{self.id_base}_{index}"

    def call_id(self, index: int) -> str:
        return f"call_{self.id_base}_{index}"

    def reasoning_id(self, index: int) -> str:
        return f"rs_{self.id_base}_{index}"


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message output item; `text` None: the item as just opened (no part yet)."""
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A reasoning output item (a worker's `reasoning_content`: its `<think>` text), the text as
    one `reasoning_text` part; `text` None: the item as just opened."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(translated: ResponsesTranslated, item_id: str, call_id: str, chat_name: str,
              arguments: str, status: str) -> dict[str, Any]:
    """A function_call output item; a flattened namespace function goes back as Codex looks
    it up: its own name and its namespace."""
    name, namespace = translated.tools.called(chat_name)
    item = {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def final_status(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """The response's status and incomplete_details for the chat finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def settle(items: list[dict[str, Any]], status: str) -> list[dict[str, Any]]:
    """Every item completed, but the last one of an incomplete response: it was cut off."""
    for index, item in enumerate(items):
        item["status"] = "incomplete" if status == "incomplete" and index == len(items) - 1 else "completed"
    return items


def usage(chat_usage: Any) -> dict[str, Any]:
    """Chat usage in Responses' terms (zeros where the chat path gave none)."""
    chat = chat_usage if isinstance(chat_usage, dict) else {}
    details = chat.get("prompt_tokens_details") if isinstance(chat.get("prompt_tokens_details"), dict) else {}
    prompt = _count(chat.get("prompt_tokens"))
    completion = _count(chat.get("completion_tokens"))
    return {
        "input_tokens": prompt,
        # cache_write_tokens: the openai SDK requires it; the chat path reports it only for a
        # request with cache breakpoints, which a Responses request never has.
        "input_tokens_details": {"cached_tokens": _count(details.get("cached_tokens")),
                                 "cache_write_tokens": _count(details.get("cache_write_tokens"))},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def response_object(translated: ResponsesTranslated, model: str | None, status: str,
                    output: list[dict[str, Any]], usage_: dict[str, Any] | None,
                    incomplete: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `response` object, with the request fields the openai SDK's `Response` expects."""
    return {
        "id": translated.response_id,
        "object": "response",
        "created_at": translated.created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": incomplete,
        "model": model or translated.model or "",
        "output": output,
        "usage": usage_,
        **translated.echo,
    }


def echo_fields(body: dict[str, Any], store: bool, parallel_tool_calls: bool) -> dict[str, Any]:
    """What a response repeats of its request, in the API's defaults where it said nothing."""
    tools = body.get("tools")
    choice = body.get("tool_choice")

    def number(key: str, default: float) -> float:
        value = body.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default

    def text(key: str) -> str | None:
        value = body.get(key)
        return value if isinstance(value, str) else None

    reasoning = body.get("reasoning")
    metadata = body.get("metadata")
    max_tokens = body.get("max_output_tokens")
    return {
        "instructions": text("instructions"),
        "max_output_tokens": max_tokens if isinstance(max_tokens, int) else None,
        "metadata": metadata if isinstance(metadata, dict) else {},
        "parallel_tool_calls": parallel_tool_calls,
        "previous_response_id": text("previous_response_id"),
        "prompt_cache_key": text("prompt_cache_key"),
        "reasoning": ({"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}
                      if isinstance(reasoning, dict) else {"effort": None, "summary": None}),
        "safety_identifier": text("safety_identifier"),
        "service_tier": "default",
        "store": store,
        "temperature": number("temperature", 1.0),
        "text": {"format": {"type": "text"}},
        "tool_choice": choice if isinstance(choice, (str, dict)) else "auto",
        "tools": [t for t in tools if isinstance(t, dict)] if isinstance(tools, list) else [],
        "top_logprobs": 0,
        "top_p": number("top_p", 1.0),
        "truncation": "disabled",
        "user": text("user"),
    }


def failure(payload: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI error payload (`{"error": {...}}`) as a failed response's `error`, with the
    codes Codex reads: `rate_limit_exceeded` it retries after the delay the message names,
    `context_length_exceeded` it reports, anything else (`server_error`) it retries."""
    error = payload.get("error") if isinstance(payload.get("error"), dict) else {}
    message = error.get("message") if isinstance(error.get("message"), str) else "the response failed"
    code = error.get("code")
    if error.get("type") == "rate_limit_error" or code in ("rate_limit_exceeded", "overloaded"):
        code = "rate_limit_exceeded"
    elif code != "context_length_exceeded":
        code = "server_error"
    return {"code": code, "message": message}


def whole_response(translated: ResponsesTranslated, chat_reply: dict[str, Any]) -> dict[str, Any]:
    """A whole `chat.completion` as a response: its reasoning (a worker's reasoning_content),
    the message (if it says anything), then its calls, each at its position in `output`."""
    choices = chat_reply.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    items: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        items.append(reasoning_item(translated.reasoning_id(0), reasoning, "completed"))
    text = message.get("content")
    if isinstance(text, str) and text:
        items.append(message_item(translated.message_id(len(items)), text, "completed"))
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        if not isinstance(call, dict):
            continue
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        index = len(items)
        call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else translated.call_id(index)
        items.append(call_item(translated, translated.call_item_id(index), call_id,
                               str(function.get("name") or ""), str(function.get("arguments") or ""),
                               "completed"))
    status, incomplete = final_status(choice.get("finish_reason"))
    model = chat_reply.get("model")
    return response_object(translated, model if isinstance(model, str) else None, status,
                           settle(items, status), usage(chat_reply.get("usage")), incomplete)
