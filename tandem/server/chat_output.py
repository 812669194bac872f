"""One chat sequence's output text → its reasoning, its answer text and its tool calls.

Text goes through the reasoning parser first (its `<think>` part becomes `reasoning_content`)
and what is left, the answer, through the tool parser; both are streaming parsers whose whole
result is their stream's, so a whole reply and a stream are one code path: `chat_reply` feeds
the whole text at once, `chat_chunks` each delta.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from tandem.server.reasoning import ReasoningParser, ReasoningStream
from tandem.server.tool_parsers import ToolCallDelta, ToolParser, ToolStreamParser


@dataclass
class OutputDelta:
    """What one step lets the server send for a sequence."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class SequenceOutput:
    """Per-sequence parser state; `feed` each new piece of text, `final` with the last one."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolStreamParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @classmethod
    def start(cls, prompt_text: str, forced_prefix: str, reasoning: ReasoningParser | None,
              tools: ToolParser | None, tool_names: Collection[str]) -> SequenceOutput:
        # A forced call (tool_choice required or named) opens in the prompt: the output is
        # inside the call, never reasoning.
        thinking = reasoning.stream(prompt_text) if reasoning is not None and not forced_prefix else None
        calls = tools.stream(forced_prefix, tool_names) if tools is not None else None
        return cls(thinking, calls)

    @property
    def called_tools(self) -> bool:
        return self._tools is not None and self._tools.called_tools

    def feed(self, text: str, final: bool = False) -> OutputDelta:
        out = OutputDelta()
        answer = text
        if self._reasoning is not None:
            split = self._reasoning.feed(text)
            if final:
                split.extend(self._reasoning.finish())
            out.reasoning, answer = split.reasoning, split.content
        if self._tools is None:
            out.content = answer
            return out
        pieces = self._tools.feed(answer)
        if final:
            pieces.extend(self._tools.finish())
        out.content, out.tool_calls = pieces.content, pieces.tool_calls
        return out
