"""Run a tool-call stream the way the server does, checking the per-piece rules (id and name
on a call's first piece only, calls numbered in order) while reassembling it; and the split
patterns the property tests feed it."""

from __future__ import annotations

import random
import re
from collections.abc import Collection, Iterable, Iterator

from tandem.server.tool_parsers import ParsedMessage, StreamDelta, ToolParser

_KIMI_ID = re.compile(r"functions\.[^:]+:\d+")


def check_pieces(deltas: list[StreamDelta]) -> None:
    seen: set[int] = set()
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.index in seen:
                assert piece.id is None and piece.name is None, "id/name repeated"
                continue
            assert piece.index == len(seen), "calls must be numbered 0, 1, 2, ..."
            # OpenAI-style ids, or the `functions.NAME:IDX` ids Kimi-K2 writes itself
            assert piece.id is not None and (piece.id.startswith("call_") or _KIMI_ID.fullmatch(piece.id))
            assert piece.name
            seen.add(piece.index)


def run_stream(parser: ToolParser, chunks: Iterable[str], prefix: str = "",
               tool_names: Collection[str] = ()) -> ParsedMessage:
    """Feed `prefix` then `chunks`, then finish; the prefix alone must emit nothing."""
    stream = parser.stream(tool_names=tool_names)
    deltas = []
    if prefix:
        first = stream.feed(prefix)
        assert not first, f"feeding the forced prefix emitted {first!r}"
    deltas.extend(stream.feed(chunk) for chunk in chunks)
    deltas.append(stream.finish())
    check_pieces(deltas)
    parsed = ParsedMessage.from_deltas(deltas)
    assert stream.called_tools == bool(parsed.tool_calls)
    return parsed


def summary(message: ParsedMessage) -> tuple[str, list[tuple[str, str]]]:
    """What stream and non-stream must agree on: everything but the random ids."""
    return message.content or "", [(c.name, c.arguments) for c in message.tool_calls]


def splits(text: str, seed: int = 0, random_rounds: int = 20) -> Iterator[list[str]]:
    """Every fixed chunk size, every single cut point, and seeded random cuts."""
    n = max(len(text), 1)
    for size in range(1, n + 1):
        yield [text[i : i + size] for i in range(0, len(text), size)]
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    rng = random.Random(seed)
    for _ in range(random_rounds):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 8))))
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
