"""Reasoning formats by name (`--reasoning-parser`). All three write `<think>…</think>`; they
are named apart because users know them by model, and a future format need not."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from tandem.server.reasoning.base import ReasoningParser
from tandem.server.reasoning.think_tags import ThinkTagsParser

REASONING_PARSERS: Mapping[str, Callable[[], ReasoningParser]] = MappingProxyType({
    "deepseek_r1": ThinkTagsParser,
    "qwen3": ThinkTagsParser,
    "kimi_k2": ThinkTagsParser,
})


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        make = REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; supported: {', '.join(sorted(REASONING_PARSERS))}") from None
    return make()
