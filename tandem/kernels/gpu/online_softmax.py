"""One step of attention with an online softmax, shared by the decode and prefill kernels:
a block of keys and values from the paged cache folded into running (max, sum, output)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_block(q, keys, values, where, kv_mask, visible, scale, m, total, acc, PRECISION: tl.constexpr):
    """q [rows, dim] against the block's keys at `where` (rows of the block outside `kv_mask`
    read as zeros), scores outside `visible` dropped; returns the new (m, total, acc)."""
    k = tl.load(keys + where, mask=kv_mask, other=0.0).to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    total = total * alpha + tl.sum(p, 1)
    v = tl.load(values + where, mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    return m_new, total, acc
