"""Incremental detokenization and stop strings, per sequence.

Byte-level BPE splits multi-byte characters across tokens; decoding a token alone yields
U+FFFD. We decode a sliding window (a few tokens of already-emitted context plus the new
ones) and release text only when it no longer ends in a partial character, which also
keeps SentencePiece's leading-space handling right.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 preserved_token_ids: Collection[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Skipping special tokens but some: those are dropped here, the rest decoded as they are.
        self._dropped: frozenset[int] | None = (
            special_token_ids(tokenizer) - frozenset(preserved_token_ids)
            if skip_special_tokens and preserved_token_ids else None)
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self._dropped is not None:
            return self.tokenizer.decode([i for i in ids if i not in self._dropped], skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append a token; return the newly complete text (possibly empty)."""
        self.tokens.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """Release whatever is held back (at the end of the sequence)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        self.text += delta
        return delta


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids `decode(..., skip_special_tokens=True)` leaves out: added tokens marked special."""
    return frozenset(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_len` characters: (index, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
