"""The three wire protocols a serve benchmark can speak: what one turn sends, what it reads.

`tandem bench serve --protocol chat,messages,responses` runs the same conversations as Chat
Completions, Anthropic Messages and OpenAI Responses requests, so the cost of translating at
the edge is measured, not assumed. Each protocol's stream is read into the chat form the
meter already understands: output text as it arrives, the end of the stream, an error, and
usage as `{"prompt_tokens", "completion_tokens", "prompt_tokens_details": {"cached_tokens"}}`
(Anthropic's prompt is its input + cache-read + cache-creation tokens, its cached tokens the
cache reads; Responses' are `input_tokens` and `input_tokens_details.cached_tokens`).

The extras tandem accepts beside each protocol's own fields go in the body as they do for
chat: `ignore_eos`, so every protocol generates exactly `max_tokens`, and `cache_salt`, which
keeps an interleaved run's protocols from reading each other's prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PROTOCOLS = ("chat", "messages", "responses")
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def request_body(protocol: str, model: str, messages: list[dict[str, Any]], max_tokens: int,
                 temperature: float, ignore_eos: bool) -> dict[str, Any]:
    """One streamed turn of a conversation (chat-style `messages`) in `protocol`."""
    extras = {"ignore_eos": True} if ignore_eos else {}
    if protocol == "chat":
        return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "stream": True, "stream_options": {"include_usage": True}, **extras}
    system = [m["content"] for m in messages if m["role"] == "system"]
    turns = [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"]
    if protocol == "messages":
        body: dict[str, Any] = {"model": model, "messages": turns, "max_tokens": max_tokens,
                                "temperature": temperature, "stream": True, **extras}
        if system:
            body["system"] = "\n".join(system)
        return body
    if protocol == "responses":
        body = {"model": model, "input": turns, "max_output_tokens": max_tokens, "temperature": temperature,
                "stream": True, "store": False, **extras}
        if system:
            body["instructions"] = "\n".join(system)
        return body
    raise ValueError(f"unknown protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}")


@dataclass
class Event:
    """One stream event read into what the meter needs."""

    text: str = ""
    done: bool = False
    error: str | None = None
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None


def read_event(protocol: str, data: dict[str, Any]) -> Event:
    """A decoded `data:` payload of a `protocol` stream (chat's `[DONE]` is handled before)."""
    if protocol == "messages":
        return _messages_event(data)
    if protocol == "responses":
        return _responses_event(data)
    return _chat_event(data)


def _error_text(error: Any) -> str:
    return str(error.get("message", error) if isinstance(error, dict) else error)


def _chat_event(data: dict[str, Any]) -> Event:
    if data.get("error"):
        return Event(error=_error_text(data["error"]))
    event = Event(usage=data["usage"] if isinstance(data.get("usage"), dict) else None)
    for choice in data.get("choices") or ():
        event.text += _choice_output(choice)
        if choice.get("finish_reason"):
            event.finish_reason = choice["finish_reason"]
    return event


def _choice_output(choice: dict[str, Any]) -> str:
    """The output a chunk's choice carries: completion text, or a chat delta's content,
    reasoning or tool-call pieces (rendered as text for the conversation history)."""
    if isinstance(choice.get("text"), str):
        return choice["text"]
    delta = choice.get("delta") or {}
    out = ""
    for key in ("reasoning_content", "reasoning", "content"):
        if isinstance(delta.get(key), str):
            out += delta[key]
    for call in delta.get("tool_calls") or ():
        function = call.get("function") or {}
        out += (function.get("name") or "") + (function.get("arguments") or "")
    return out


_STOP_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}


def _messages_event(data: dict[str, Any]) -> Event:
    kind = data.get("type")
    if kind == "error":
        return Event(error=_error_text(data.get("error")))
    if kind == "message_stop":
        return Event(done=True)
    if kind == "content_block_delta":
        delta = data.get("delta") or {}
        text = delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""
        return Event(text=text if isinstance(text, str) else "")
    if kind == "content_block_start":
        block = data.get("content_block") or {}
        return Event(text=block.get("name", "") if block.get("type") == "tool_use" else "")
    if kind == "message_delta":
        usage = data.get("usage") or {}
        read = int(usage.get("cache_read_input_tokens") or 0)
        prompt = int(usage.get("input_tokens") or 0) + read + int(usage.get("cache_creation_input_tokens") or 0)
        reason = (data.get("delta") or {}).get("stop_reason")
        return Event(usage={"prompt_tokens": prompt, "completion_tokens": usage.get("output_tokens"),
                            "prompt_tokens_details": {"cached_tokens": read}},
                     finish_reason=_STOP_REASONS.get(reason, reason))
    return Event()


def _responses_event(data: dict[str, Any]) -> Event:
    kind = data.get("type")
    if kind in ("response.output_text.delta", "response.function_call_arguments.delta",
                "response.reasoning_text.delta"):
        delta = data.get("delta")
        return Event(text=delta if isinstance(delta, str) else "")
    if kind in ("response.completed", "response.incomplete"):
        response = data.get("response") or {}
        usage = response.get("usage") or {}
        details = usage.get("input_tokens_details") or {}
        finish = "length" if kind == "response.incomplete" else "stop"
        return Event(done=True, finish_reason=finish,
                     usage={"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens"),
                            "prompt_tokens_details": {"cached_tokens": details.get("cached_tokens")}})
    if kind == "response.failed":
        error = (data.get("response") or {}).get("error") or "response failed"
        return Event(error=_error_text(error))
    if kind == "error":
        return Event(error=_error_text(data.get("error") or data.get("message") or data))
    return Event()
