"""The seam between a client protocol and the internal Chat Completions form.

An adapter does three things, each a pure function of what it is given:

- `to_chat`: the client's request body (and headers) → a Chat Completions request body, plus
  the session the request belongs to (for the router's affinity) and what was dropped;
- `reply`: a whole `chat.completion` → the protocol's whole response;
- `stream`: a `StreamTranslator` that turns the `chat.completion.chunk`s of one response into
  the protocol's server-sent events, in order, ending the stream the protocol's way.

Errors keep their status and are reshaped by `error_body` (Anthropic's
`{"type": "error", "error": {...}}`, OpenAI's `{"error": {...}}`).

A protocol that keeps what it answered (the Responses API's store) does so in `reply` and in
`finish`, which the server and the router await with the whole response a stream ended with
(`StreamTranslator.final`) before its last events go out: a client that continues the
conversation the moment it reads them finds it kept.

The internal form carries two things a plain chat request does not: a content part's
`cache_control` (a cache breakpoint, as Anthropic marks them; the worker reports the tokens
written up to the last one as `prompt_tokens_details.cache_write_tokens`), and nothing else
protocol-specific: an adapter that needs more must add it to the chat form for every protocol.
"""

from __future__ import annotations

import contextlib
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

logger = logging.getLogger(__name__)


@dataclass
class Translated:
    """A client request in the internal form."""

    chat: dict[str, Any]  # a Chat Completions request body
    session: str | None = None  # the agent's own session id, for the router's affinity
    dropped: list[str] = field(default_factory=list)  # what was ignored (a warning header says so)


# What an adapter ignored (hosted tools, unknown item types), named for the client in one header.
DROPPED_HEADER = "x-tandem-ignored"


def dropped_headers(translated: Translated) -> dict[str, str]:
    return {DROPPED_HEADER: ", ".join(translated.dropped)[:1000]} if translated.dropped else {}


class StreamTranslator(ABC):
    """One response's chat chunks → the protocol's events (each a complete SSE event string)."""

    # The whole response the stream ended with, once `close` made it (None: none, or it failed).
    final: dict[str, Any] | None = None

    @abstractmethod
    def feed(self, chunk: dict[str, Any]) -> list[str]:
        """The events for one `chat.completion.chunk` (possibly none)."""

    @abstractmethod
    def error(self, payload: dict[str, Any]) -> list[str]:
        """An OpenAI-shaped error event (`{"error": {...}}`) that arrived mid-stream."""

    @abstractmethod
    def close(self) -> list[str]:
        """The events after the last chunk (the chat stream's `[DONE]`)."""


class ProtocolAdapter(ABC):
    """A client protocol translated to and from the internal chat form."""

    name: ClassVar[str]  # "messages" | "responses": metrics and logs label requests by it

    @abstractmethod
    async def to_chat(self, body: dict[str, Any], headers: Mapping[str, str], caller: str = "") -> Translated:
        """The internal request; `APIError` (400) for a body this protocol refuses. `caller` is
        who the API-key check found (the router's key identity; "" where there is none): a
        protocol that keeps state between requests keeps each caller's apart by it."""

    @abstractmethod
    async def reply(self, chat_reply: dict[str, Any], translated: Translated) -> dict[str, Any]:
        """A whole chat reply as this protocol's whole response."""

    @abstractmethod
    def stream(self, translated: Translated) -> StreamTranslator:
        """A translator for one streamed response."""

    @abstractmethod
    def error_body(self, status: int, openai_body: dict[str, Any]) -> dict[str, Any]:
        """An OpenAI-shaped error body in this protocol's shape."""

    def reply_id(self, translated: Translated, chat_id: str) -> str:
        """The id the client will see for a request whose chat id is `chat_id` (the usage
        ledger records it, so a client's id finds its row). The chat id by default."""
        return chat_id

    async def finish(self, translated: Translated, response: dict[str, Any]) -> None:
        """A streamed response's end (`StreamTranslator.final`), before its last events go out:
        a protocol that keeps its responses keeps it here. Nothing by default."""
        return None


async def finish_stream(adapter: ProtocolAdapter, translated: Translated, translator: StreamTranslator) -> None:
    """`adapter.finish` with the response the translator ended with, if it ended with one."""
    if translator.final is not None:
        await adapter.finish(translated, translator.final)


# The extras tandem's chat endpoint accepts beside OpenAI's fields (vLLM's names), taken as
# they are from a Messages or Responses body too: the chat request model range-checks them, so
# an adapter only copies them. `ignore_eos` lets a benchmark generate exactly max_tokens in
# every protocol; `cache_salt` keeps a request's prefix cache apart from requests without it
# (the router salts it further per tenant, as it does a chat request's).
CHAT_EXTRAS = ("ignore_eos", "min_tokens", "min_p", "repetition_penalty", "seed", "cache_salt")


def chat_extras(body: Mapping[str, Any]) -> dict[str, Any]:
    """The extras a client body carries, for the chat request."""
    return {name: body[name] for name in CHAT_EXTRAS if name in body}


def sse_event(event: str | None, payload: dict[str, Any]) -> str:
    """One server-sent event; `event` names it (Anthropic and Responses streams name theirs)."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


Finish = Callable[[], Awaitable[None]]


async def translate_sse(events: AsyncIterator[str], translator: StreamTranslator,
                        on_close: Finish | None = None) -> AsyncIterator[str]:
    """A chat SSE body (`data: {...}` events, `data: [DONE]`) in the protocol's events.

    The router's relay and the server's chat stream both write one event per string; an error
    event (`{"error": ...}` without `choices`) is handed to the translator as such. `on_close`
    is awaited after the translator's closing events are made and before they go out."""
    done = False
    async with contextlib.AsyncExitStack() as stack:
        if hasattr(events, "aclose"):  # closing this stream closes the one it reads (and its hop)
            await stack.enter_async_context(contextlib.aclosing(events))  # type: ignore[type-var]
        async for out in _translated(events, translator, on_close):
            if out is _DONE:
                done = True
                continue
            yield out
    if not done:
        for out in await _closed(translator, on_close):
            yield out


_DONE = "\x00done"


async def _closed(translator: StreamTranslator, on_close: Finish | None) -> list[str]:
    events = translator.close()
    if on_close is not None:
        await on_close()
    return events


async def _translated(events: AsyncIterator[str], translator: StreamTranslator,
                      on_close: Finish | None) -> AsyncIterator[str]:
    async for text in events:
        for line in text.split("\n"):
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                for out in await _closed(translator, on_close):
                    yield out
                yield _DONE
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                logger.warning("dropping a malformed chat event: %.200s", data)
                continue
            if not isinstance(chunk, dict):
                continue
            outs = translator.error(chunk) if "error" in chunk and "choices" not in chunk else translator.feed(chunk)
            for out in outs:
                yield out
