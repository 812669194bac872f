"""Reasoning parsing for the OpenAI server: a model's `<think>…</think>` apart from its answer.

See `base` for the contract; `registry` names the formats (`--reasoning-parser`)."""

from tandem.server.reasoning.base import ReasoningParser, ReasoningStream
from tandem.server.reasoning.registry import REASONING_PARSERS, get_reasoning_parser

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]
