"""A chat reply as an Anthropic Message: content blocks, stop reason, usage, errors.

What the whole reply (`message_reply`) and the stream (anthropic_stream.py) share, so that
the two say the same thing about the same output:

- `ThinkSplitter`: with thinking requested, output that starts with `<think>` is split into a
  `thinking` block (up to `</think>`) and text (leading whitespace after `</think>` dropped).
  It is fed text in pieces and holds back what could still be a partial tag, so the stream
  splits the same way at every chunk boundary; the whole reply is one piece.
- Text beside tool calls: the chat reply drops whitespace-only content when there are calls,
  and a stream cannot know whether whitespace is followed by a call, so trailing whitespace
  is never sent until more text follows, and beside tool calls it is dropped. The text block
  is left out when it is empty and other blocks exist; a reply with nothing at all holds one
  empty text block.
- `stop_reason`: `tool_calls` → `tool_use`, `length` → `max_tokens`, a `stop` whose matched
  string (the chat choice's `stop_reason`, a vLLM extension) is one of the request's
  `stop_sequences` → `stop_sequence` with that string, anything else → `end_turn`.
- `usage`: `cache_read_input_tokens` is the chat `prompt_tokens_details.cached_tokens`,
  `cache_creation_input_tokens` its `cache_write_tokens` (tokens up to the last
  `cache_control` breakpoint that were not read from the cache), `input_tokens` the rest of
  `prompt_tokens`: the three add up to the prompt's exact token count.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# Anthropic's error type per status; other 4xx are invalid_request_error, 5xx api_error.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# The status behind an OpenAI error type, for an error event that carries no status.
_OPENAI_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "rate_limit_error": 429,
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, openai_body: Any) -> dict[str, Any]:
    """An OpenAI-shaped error body as Anthropic's `{"type": "error", "error": {...}}`."""
    error = openai_body.get("error") if isinstance(openai_body, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    return {"type": "error", "error": {"type": error_type(status),
                                       "message": str(message) if message else f"HTTP {status}"}}


def event_status(openai_body: Any) -> int:
    """The status of a mid-stream error event: its numeric `code`, else its OpenAI `type`'s."""
    error = openai_body.get("error") if isinstance(openai_body, dict) else None
    if not isinstance(error, dict):
        return 500
    code = error.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600:
        return code
    return _OPENAI_STATUS.get(str(error.get("type")), 500)


def message_id(chat_id: Any) -> str:
    """`msg_` + the chat response's id, so a reply and its log lines can be matched."""
    if isinstance(chat_id, str) and chat_id:
        return "msg_" + chat_id.removeprefix("chatcmpl-")
    return "msg_" + secrets.token_hex(12)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def usage(chat_usage: Any) -> dict[str, int]:
    """Anthropic's usage from a chat `usage` (zeros where it is missing)."""
    chat_usage = chat_usage if isinstance(chat_usage, dict) else {}
    details = chat_usage.get("prompt_tokens_details")
    details = details if isinstance(details, dict) else {}
    prompt = _count(chat_usage.get("prompt_tokens"))
    read = min(_count(details.get("cached_tokens")), prompt)
    written = min(_count(details.get("cache_write_tokens")), prompt - read)
    return {
        "input_tokens": prompt - read - written,
        "output_tokens": _count(chat_usage.get("completion_tokens")),
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": read,
    }


def stop_reason(finish_reason: Any, matched: Any, stop_sequences: list[str]) -> tuple[str, str | None]:
    """(`stop_reason`, `stop_sequence`) for a chat choice's finish and matched stop string."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def tool_input(arguments: Any) -> dict[str, Any]:
    """A call's JSON-text arguments as the object `tool_use.input` is ({} if not one)."""
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that could begin `tag` (held back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ThinkSplitter:
    """Output text → ("thinking" | "text", piece)s; ("thinking", "") opens the thinking part.

    Off (thinking not requested): all text. On: text that starts with `<think>` is thinking up
    to `</think>`, then text without its leading whitespace. Streaming-safe: a piece that may
    still become `<think>` or `</think>` is held until the next one decides it."""

    def __init__(self, enabled: bool) -> None:
        self.state = "start" if enabled else "text"
        self.held = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self.held += text
        if self.state == "start":
            if self.held.startswith(THINK_OPEN):
                self.held = self.held[len(THINK_OPEN):]
                self.state = "thinking"
                out.append(("thinking", ""))
            elif THINK_OPEN.startswith(self.held):
                return out
            else:
                self.state = "text"
        if self.state == "thinking":
            end = self.held.find(THINK_CLOSE)
            if end < 0:
                keep = len(self.held) - _partial_suffix(self.held, THINK_CLOSE)
                if keep:
                    out.append(("thinking", self.held[:keep]))
                    self.held = self.held[keep:]
                return out
            if end:
                out.append(("thinking", self.held[:end]))
            self.held = self.held[end + len(THINK_CLOSE):]
            self.state = "after"
        if self.state == "after":
            self.held = self.held.lstrip()
            if not self.held:
                return out
            self.state = "text"
        if self.held:
            out.append(("text", self.held))
            self.held = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        held, self.held = self.held, ""
        if not held or self.state == "after":
            return []
        return [("thinking" if self.state == "thinking" else "text", held)]


def split_output(content: str, thinking: bool) -> tuple[str | None, str]:
    """(thinking or None, text) of a whole output, exactly as the stream splits it."""
    splitter = ThinkSplitter(thinking)
    pieces = splitter.feed(content) + splitter.finish()
    thought = [p for kind, p in pieces if kind == "thinking"]
    return ("".join(thought) if thought else None), "".join(p for kind, p in pieces if kind == "text")


def message_reply(chat_reply: dict[str, Any], thinking: bool, stop_sequences: list[str]) -> dict[str, Any]:
    """A whole `chat.completion` (its first choice) as an Anthropic Message."""
    choices = chat_reply.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    content = message.get("content") if isinstance(message.get("content"), str) else ""
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    thought, text = split_output(content, thinking)
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning and thinking:  # a server's --reasoning-parser split it
        thought = reasoning + (thought or "")
    blocks: list[dict[str, Any]] = []
    if thought is not None:
        blocks.append({"type": "thinking", "thinking": thought, "signature": ""})
    if calls:
        text = text.rstrip()
    if text or (not calls and not blocks):
        blocks.append({"type": "text", "text": text})
    for call in calls:
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        blocks.append({"type": "tool_use", "id": call.get("id") or "toolu_" + secrets.token_hex(12),
                       "name": function.get("name") or "", "input": tool_input(function.get("arguments"))})
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), stop_sequences)
    return {
        "id": message_id(chat_reply.get("id")),
        "type": "message",
        "role": "assistant",
        "model": chat_reply.get("model"),
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(chat_reply.get("usage")),
    }
