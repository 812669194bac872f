"""A chat request's cache breakpoints as the engine's retention hint (tandem/server/cache_retention.py)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tandem.edge.openai_protocol import ChatCompletionRequest, ChatMessage
from tandem.server.cache_retention import breakpoint_ttl_seconds, chat_retention
from tandem.types import CacheRetention


def messages(*controls: dict[str, Any] | None) -> list[ChatMessage]:
    """A system message whose parts carry these cache_controls, then a plain user turn."""
    parts = [{"type": "text", "text": f"part {n}", **({"cache_control": c} if c is not None else {})}
             for n, c in enumerate(controls)]
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "system", "content": parts}, {"role": "user", "content": "hi"}]})
    return body.messages


def test_no_breakpoint_no_retention() -> None:
    assert chat_retention(messages(None, None), None) is None
    assert breakpoint_ttl_seconds(messages(None)) is None


def test_default_ttl_is_five_minutes() -> None:
    assert chat_retention(messages({"type": "ephemeral"}), 120) == CacheRetention(120, 300.0)


def test_the_longest_ttl_wins() -> None:
    marked = messages({"type": "ephemeral", "ttl": "5m"}, {"type": "ephemeral", "ttl": "1h"}, {"type": "ephemeral"})
    assert chat_retention(marked, 64) == CacheRetention(64, 3600.0)


def test_an_empty_prefix_retains_nothing() -> None:
    assert chat_retention(messages({"type": "ephemeral"}), 0) is None


@pytest.mark.parametrize("control", [{"type": "ephemeral", "ttl": "2h"}, {"type": "ephemeral", "ttl": 3600},
                                     {"type": "persistent"}])
def test_a_ttl_outside_the_protocol_is_refused_at_the_edge(control: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        messages(control)
