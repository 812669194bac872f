"""Grammar masks applied to the logits before sampling (tandem/structured fills them).

A mask row is llguidance's bitmask: int32 words, bit t of the row set when token t may come
next. Logits of tokens the row forbids become -inf, so every sampler after this (greedy,
temperature, top-k/p, the rejection sampler verifying drafts) can only pick allowed tokens,
and a request without a mask is untouched. Columns past the mask's width (a model whose
logits are wider than its tokenizer) are forbidden too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

_BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(words: np.ndarray, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: which tokens each bitmask row allows."""
    packed = torch.from_numpy(np.ascontiguousarray(words, dtype=np.int32))
    bits = (packed.unsqueeze(-1) >> _BITS) & 1
    allowed = bits.reshape(packed.shape[0], -1).bool()
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - width), value=False)


def apply_token_masks(logits: torch.Tensor, request_rows: Sequence[tuple[str, int]],
                      masks: Mapping[str, np.ndarray]) -> None:
    """Forbid, in place, what each constrained request's mask forbids. `request_rows` gives
    each request's number of logits rows, in the order of `logits`' rows."""
    rows: list[int] = []
    words: list[np.ndarray] = []
    start = 0
    for request_id, count in request_rows:
        mask = masks.get(request_id)
        if mask is not None:
            if mask.shape[0] != count:
                raise ValueError(f"request {request_id} has {count} logits rows and {mask.shape[0]} mask rows")
            rows.extend(range(start, start + count))
            words.append(mask)
        start += count
    if not rows:
        return
    allowed = allowed_tokens(np.concatenate(words), logits.shape[1]).to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    selected = logits.index_select(0, index)
    selected.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, selected)
