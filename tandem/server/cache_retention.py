"""A chat request's cache breakpoints as the engine's protocol-neutral retention hint.

A content part may carry `cache_control` ({"type": "ephemeral", "ttl": "5m" | "1h"}: how
Anthropic clients mark what is worth keeping, arriving here through the Messages adapter or
from an OpenAI-compatible client). The engine keeps the prompt up to the last breakpoint
cached ahead of unmarked prefixes under eviction pressure, for the longest TTL among the
breakpoints (docs/prompt-caching.md). The TTLs are the edge's pydantic Literal, so a value
outside them is a 400 before this runs; the engine checks the hint again on arrival.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.edge.openai_protocol import ChatMessage
from tandem.types import MAX_RETENTION_SECONDS, CacheRetention

DEFAULT_TTL = "5m"  # Anthropic's, when a breakpoint names none
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


def breakpoint_ttl_seconds(messages: Sequence[ChatMessage]) -> float | None:
    """The longest TTL among the breakpoints of the messages, in seconds (None: none marked)."""
    longest = None
    for message in messages:
        if not isinstance(message.content, list):
            continue
        for part in message.content:
            if part.cache_control is not None:
                seconds = TTL_SECONDS[part.cache_control.ttl or DEFAULT_TTL]
                longest = seconds if longest is None else max(longest, seconds)
    return longest


def chat_retention(messages: Sequence[ChatMessage], breakpoint_tokens: int | None) -> CacheRetention | None:
    """Retain the prompt's first `breakpoint_tokens` tokens (cache_breakpoint_tokens in
    serving_chat.py) for the longest TTL marked; None without a breakpoint."""
    if breakpoint_tokens is None or breakpoint_tokens <= 0:
        return None
    seconds = breakpoint_ttl_seconds(messages)
    if seconds is None:
        return None
    return CacheRetention(tokens=breakpoint_tokens, seconds=min(seconds, MAX_RETENTION_SECONDS))
