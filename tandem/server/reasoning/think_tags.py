"""Reasoning between `<think>` and `</think>`: DeepSeek-R1, Qwen3, Kimi-K2-Thinking.

The three differ only in who opens the block (see base): the parser reads that off the
prompt, so one implementation serves them all. An output that opens no block is all answer;
one that never closes its block is all reasoning (a response cut by max_tokens mid-thought).
"""

from __future__ import annotations

import enum

from tandem.server.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStream
from tandem.server.tool_parsers.base import partial_suffix

OPEN = "<think>"
CLOSE = "</think>"


def leaves_block_open(prompt: str, open_tag: str = OPEN, close_tag: str = CLOSE) -> bool:
    """Whether the prompt ends inside a think block (its last open tag is not closed)."""
    opened = prompt.rfind(open_tag)
    return opened >= 0 and prompt.rfind(close_tag) < opened


class _State(enum.Enum):
    START = "start"  # nothing decided: the output may open a block (or repeat the prompt's)
    REASONING = "reasoning"
    AFTER = "after"  # the block closed: whitespace before the answer is dropped
    ANSWER = "answer"


class ThinkTagsParser(ReasoningParser):
    name = "think"

    def __init__(self, open_tag: str = OPEN, close_tag: str = CLOSE) -> None:
        self.open_tag = open_tag
        self.close_tag = close_tag

    def constraint_starts_after(self, prompt: str) -> str | None:
        return self.close_tag if leaves_block_open(prompt, self.open_tag, self.close_tag) else None

    def stream(self, prompt: str) -> ThinkTagsStream:
        return ThinkTagsStream(self.open_tag, self.close_tag, leaves_block_open(prompt, self.open_tag, self.close_tag))


class ThinkTagsStream(ReasoningStream):
    def __init__(self, open_tag: str, close_tag: str, inside: bool) -> None:
        self.open_tag = open_tag
        self.close_tag = close_tag
        self.inside = inside  # the prompt opened the block: the output starts in it
        self.state = _State.START
        self.held = ""

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self.held += text
        if self.state is _State.START:
            head = self.held.lstrip()
            if head.startswith(self.open_tag):
                self.held = head[len(self.open_tag):]
                self.state = _State.REASONING
            elif head == "" or self.open_tag.startswith(head):
                return out
            else:  # no tag of its own: where the prompt left it
                self.state = _State.REASONING if self.inside else _State.ANSWER
        if self.state is _State.REASONING:
            end = self.held.find(self.close_tag)
            if end < 0:
                keep = len(self.held) - partial_suffix(self.held, self.close_tag)
                out.reasoning += self.held[:keep]
                self.held = self.held[keep:]
                return out
            out.reasoning += self.held[:end]
            self.held = self.held[end + len(self.close_tag):]
            self.state = _State.AFTER
        if self.state is _State.AFTER:
            self.held = self.held.lstrip()
            if not self.held:
                return out
            self.state = _State.ANSWER
        out.content += self.held
        self.held = ""
        return out

    def finish(self) -> ReasoningDelta:
        held, self.held = self.held, ""
        if self.state is _State.REASONING or (self.state is _State.START and self.inside):
            return ReasoningDelta(reasoning=held)
        if self.state is _State.AFTER:
            return ReasoningDelta()
        return ReasoningDelta(content=held)
