"""Splitting a reasoning model's output into its reasoning and its answer.

Reasoning models (DeepSeek-R1, Qwen3, Kimi-K2-Thinking) write their thinking between two
tags before the answer. Clients of the OpenAI API expect it apart, as `reasoning_content`
(vLLM's and DeepSeek's name), so that the answer (`content`, and the tool calls parsed from
it) holds only the answer.

Where a response starts depends on the prompt, not on the model: DeepSeek-R1's template ends
the generation prompt with `<think>` (so the output starts inside the reasoning and only
closes it), Qwen3's lets the model open it, and a template asked not to think writes an empty
`<think></think>` itself. So a parser is told the rendered prompt and starts inside the
reasoning exactly when the prompt leaves a think block open.

Contract (checked for every way of splitting the text):
- `feed(delta)` returns `(reasoning, content)` pieces that are safe to send now: text that may
  still become a tag is held back until it is decided;
- the concatenated pieces equal `parse(whole)`'s;
- the tags themselves never reach either part; whitespace between the closing tag and the
  answer is dropped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)

    def extend(self, other: ReasoningDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content


class ReasoningStream(ABC):
    """One response's state."""

    @abstractmethod
    def feed(self, text: str) -> ReasoningDelta:
        """New output text: what can be sent now, split."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """The end of the output: what was held back."""


class ReasoningParser(ABC):
    """One reasoning format. Stateless: share one per server."""

    name: ClassVar[str]

    @abstractmethod
    def stream(self, prompt: str) -> ReasoningStream:
        """A fresh stream for one response to `prompt` (the rendered prompt text)."""

    def constraint_starts_after(self, prompt: str) -> str | None:
        """Where an output constraint (a schema, a grammar) starts for a response to `prompt`:
        after this text when the response starts inside the reasoning; None: at once."""
        return None

    def parse(self, text: str, prompt: str) -> ReasoningDelta:
        """The whole output, split; defined through `stream` so the two never disagree."""
        stream = self.stream(prompt)
        out = stream.feed(text)
        out.extend(stream.finish())
        return out
