"""Prompt lookup (n-gram) proposals: what followed the last time these tokens appeared.

Agents quote their context: a tool call repeats a path from the prompt, an edit copies the
code it changes. The longest suffix of n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) that occurred earlier in the prompt or output proposes the tokens that
followed its earliest occurrence, as vLLM does. (The latest was tried: in an edit that copies
a code block, the latest earlier "\n```" is the prompt's closing fence, which proposes the
prose after the block instead of the code; `tandem bench spec` measured it.)

Each request's tokens are kept as a growing byte string of little-endian uint32s, extended
with only what is new each step, so a search is one `bytes.rfind` (C speed) per n instead
of a Python loop over the context.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from tandem.spec.proposer import TokenProposer

_WIDTH = 4  # bytes per token id


class NgramProposer(TokenProposer):
    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._encoded: dict[str, bytearray] = {}

    def _tokens_as_bytes(self, request_id: str, token_ids: Sequence[int]) -> bytearray:
        encoded = self._encoded.get(request_id)
        if encoded is None or len(encoded) > len(token_ids) * _WIDTH:
            encoded = self._encoded[request_id] = bytearray()
        have = len(encoded) // _WIDTH
        if have < len(token_ids):
            new = token_ids[have:]
            encoded += struct.pack(f"<{len(new)}I", *new)
        return encoded

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:
        num_tokens = len(token_ids)
        if max_tokens <= 0 or num_tokens < self.min_n + 1:
            return []
        encoded = self._tokens_as_bytes(request_id, token_ids)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            pattern = bytes(encoded[(num_tokens - n) * _WIDTH:])
            # An earlier occurrence: it ends before the last token, so something follows it.
            end = (num_tokens - 1) * _WIDTH
            start = 0
            while True:
                found = encoded.find(pattern, start, end)
                if found < 0:
                    break
                if found % _WIDTH == 0:
                    follow = found // _WIDTH + n
                    return list(token_ids[follow : follow + max_tokens])
                start = found + 1  # misaligned (inside a token): look further right
        return []

    def request_finished(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._encoded.pop(request_id, None)
