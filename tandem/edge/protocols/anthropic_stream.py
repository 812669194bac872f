"""Chat chunks → Anthropic's stream events, in Anthropic's order.

`message_start` (the message with empty content and zero usage: the prompt's counts are
known only at the end), `ping`, then each content block as `content_block_start`,
`content_block_delta`s (`thinking_delta`, `text_delta`, `input_json_delta` with the call's
argument text as it comes) and `content_block_stop`, one block at a time; then
`message_delta` with the stop reason and the whole usage (input, cache read and cache
creation tokens too, from the chat stream's final usage chunk) and `message_stop`. An error
after the start is one `error` event, and nothing follows it.

Blocks are split as the whole reply splits them (anthropic_reply.py), so the events of a
stream accumulate to the reply of the same output however the output was chunked. One
exception: text the model writes after a tool call has to open a new text block after the
call in a stream, where the whole reply has one text block before the calls; the text blocks
of the stream still join to the reply's text.
"""

from __future__ import annotations

import secrets
from typing import Any

from tandem.edge.protocols.anthropic_reply import (
    ThinkSplitter,
    error_body,
    event_status,
    message_id,
    stop_reason,
    usage,
)
from tandem.edge.protocols.base import StreamTranslator, sse_event


class MessagesStream(StreamTranslator):
    def __init__(self, model: str | None, thinking: bool, stop_sequences: list[str]) -> None:
        self.model = model
        self.stop_sequences = stop_sequences
        self.thinking = thinking
        self.splitter = ThinkSplitter(thinking)
        self.started = False
        self.ended = False
        self.index = -1  # the current block's index
        self.kind: str | None = None  # the open block's type, None when none is open
        self.blocks: dict[int, int] = {}  # a chat tool call's index → its block's index
        # Trailing whitespace of the text, sent once more text follows; beside tool calls,
        # whitespace that no text follows is dropped at the end (as the whole reply drops it).
        self.pending = ""
        self.called = False
        self.finish_reason: Any = None
        self.matched: Any = None
        self.usage: Any = None

    # --- StreamTranslator -----------------------------------------------------------
    def feed(self, chunk: dict[str, Any]) -> list[str]:
        if self.ended:
            return []
        out = [] if self.started else self._start(chunk)
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # Messages asks for one choice
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            reasoning = delta.get("reasoning_content")
            if isinstance(reasoning, str) and reasoning and self.thinking:  # the server split it out
                out += self._piece("thinking", reasoning)
            content = delta.get("content")
            if isinstance(content, str) and content:
                for kind, piece in self.splitter.feed(content):
                    out += self._piece(kind, piece)
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    out += self._tool_call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason, self.matched = choice["finish_reason"], choice.get("stop_reason")
        return out

    def error(self, payload: dict[str, Any]) -> list[str]:
        if self.ended:
            return []
        self.ended = True
        return [sse_event("error", error_body(event_status(payload), payload))]

    def close(self) -> list[str]:
        if self.ended:
            return []
        out = [] if self.started else self._start({})
        self.ended = True
        for kind, piece in self.splitter.finish():
            out += self._piece(kind, piece)
        if not self.called and self.pending:
            out += self._text(self.pending)
        if self.index < 0:  # nothing at all: one empty text block, as the whole reply has
            out += self._open({"type": "text", "text": ""})
        out += self._close_block()
        reason, sequence = stop_reason(self.finish_reason, self.matched, self.stop_sequences)
        out.append(sse_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(self.usage),
        }))
        out.append(sse_event("message_stop", {"type": "message_stop"}))
        return out

    # --- blocks ---------------------------------------------------------------------
    def _start(self, chunk: dict[str, Any]) -> list[str]:
        self.started = True
        model = chunk.get("model") if isinstance(chunk.get("model"), str) else self.model
        message = {
            "id": message_id(chunk.get("id")), "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(None),
        }
        return [sse_event("message_start", {"type": "message_start", "message": message}),
                sse_event("ping", {"type": "ping"})]

    def _open(self, block: dict[str, Any]) -> list[str]:
        out = self._close_block()
        self.index += 1
        self.kind = block["type"]
        out.append(sse_event("content_block_start",
                             {"type": "content_block_start", "index": self.index, "content_block": block}))
        return out

    def _close_block(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, index: int, delta: dict[str, Any]) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

    def _piece(self, kind: str, piece: str) -> list[str]:
        if kind == "text":
            combined = self.pending + piece
            sent = combined.rstrip()
            self.pending = combined[len(sent):]
            return self._text(sent) if sent else []
        out = [] if self.kind == "thinking" else self._open({"type": "thinking", "thinking": "", "signature": ""})
        if piece:
            out.append(self._delta(self.index, {"type": "thinking_delta", "thinking": piece}))
        return out

    def _text(self, text: str) -> list[str]:
        out = [] if self.kind == "text" else self._open({"type": "text", "text": ""})
        if text:
            out.append(self._delta(self.index, {"type": "text_delta", "text": text}))
        return out

    def _tool_call(self, call: dict[str, Any]) -> list[str]:
        position = call.get("index") if isinstance(call.get("index"), int) else 0
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        arguments = function.get("arguments")
        out: list[str] = []
        if position not in self.blocks:
            self.called = True
            out += self._open({"type": "tool_use", "id": call.get("id") or "toolu_" + secrets.token_hex(12),
                               "name": function.get("name") or "", "input": {}})
            self.blocks[position] = self.index
        if isinstance(arguments, str) and arguments:
            out.append(self._delta(self.blocks[position], {"type": "input_json_delta", "partial_json": arguments}))
        return out
