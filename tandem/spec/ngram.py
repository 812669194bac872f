"""Prompt lookup (n-gram) proposals: what followed the first time these tokens appeared.

Agents quote their context: a tool call repeats a path from the prompt, an edit copies the
code it changes. The longest suffix of n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) that occurred earlier in the prompt or output proposes the tokens that
followed its earliest occurrence, as vLLM does. (The latest was tried: in an edit that copies
a code block, the latest earlier "\n```" is the prompt's closing fence, which proposes the
prose after the block instead of the code; `tandem bench spec` measured it.)

Each request's tokens are kept as a growing byte string of little-endian uint32s, extended
with only what is new each step, so a search is one `bytes.find` (C speed) per n tried
instead of a Python loop over the context, and the longest n is found by bisection. A call
costs about 45 us at 8k tokens of context with n = 2-5, 100 us with n up to 24 (2-core EPYC).
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
        return self.lookup(request_id, token_ids, max_tokens)[1]

    def lookup(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> tuple[int, list[int]]:
        """(n, proposal): the length n of the longest tail that occurred earlier and up to
        `max_tokens` tokens that followed its earliest occurrence; (0, []) when none did.

        A tail of n tokens that occurred earlier implies its last n - 1 tokens did too, so the
        longest n is found by bisection after trying the shortest (nothing occurred: one
        search, as in prose) and the longest (a long copy: two searches)."""
        num_tokens = len(token_ids)
        longest = min(self.max_n, num_tokens - 1)
        if max_tokens <= 0 or longest < self.min_n:
            return 0, []
        encoded = self._tokens_as_bytes(request_id, token_ids)
        start = self._earliest(encoded, num_tokens, self.min_n)
        if start < 0:
            return 0, []
        found_n = self.min_n
        if longest > found_n:
            at_longest = self._earliest(encoded, num_tokens, longest)
            if at_longest >= 0:
                found_n, start = longest, at_longest
            else:
                lo, hi = found_n + 1, longest - 1  # the longest n that occurred is in [found_n, hi]
                while lo <= hi:
                    n = (lo + hi + 1) // 2
                    at = self._earliest(encoded, num_tokens, n)
                    if at < 0:
                        hi = n - 1
                    else:
                        found_n, start, lo = n, at, n + 1
        follow = start + found_n
        return found_n, list(token_ids[follow : follow + max_tokens])

    @staticmethod
    def _earliest(encoded: bytearray, num_tokens: int, n: int) -> int:
        """Where the earliest occurrence of the last n tokens starts (in tokens), among those
        that end before the last token (so that something follows); -1 if none does."""
        pattern = bytes(encoded[(num_tokens - n) * _WIDTH:])
        end = (num_tokens - 1) * _WIDTH
        start = 0
        while True:
            found = encoded.find(pattern, start, end)
            if found < 0:
                return -1
            if found % _WIDTH == 0:
                return found // _WIDTH
            start = found + 1  # misaligned (inside a token): look further right

    def request_finished(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._encoded.pop(request_id, None)
