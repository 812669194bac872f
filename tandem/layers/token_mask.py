"""Grammar masks applied to the logits before sampling (tandem/structured fills them).

A mask row is llguidance's bitmask: int32 words, bit t of the row set when token t may come
next. Logits of tokens the row forbids become -inf, so every sampler after this (greedy,
temperature, top-k/p, the rejection sampler verifying drafts) can only pick allowed tokens,
and a request without a mask is untouched. Columns past the mask's width (a model whose
logits are wider than its tokenizer) are forbidden too.

The rows are unpacked by numpy's unpackbits and applied by one `torch.where` written over the
logits: at batch 32 on a 152k vocabulary a bit-shifting unpack and a boolean `masked_fill_`
took tens of milliseconds a step, a sizeable part of a small model's forward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch


def allowed_tokens(words: np.ndarray, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: which tokens each bitmask row allows."""
    packed = np.ascontiguousarray(words, dtype="<i4")  # bit t of word t // 32, low bit first
    bits = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little").view(np.bool_)
    allowed = torch.from_numpy(bits)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)


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
    forbidden = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    if len(rows) == logits.shape[0]:  # every row constrained (the rows are 0..n-1 in order)
        torch.where(allowed, logits, forbidden, out=logits)
        return
    index = torch.tensor(rows, device=logits.device)
    logits.index_copy_(0, index, torch.where(allowed, logits.index_select(0, index), forbidden))
