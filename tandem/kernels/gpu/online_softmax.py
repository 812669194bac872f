"""One step of attention with an online softmax, shared by the decode and prefill kernels:
a tile of keys and values from the paged cache folded into running (max, sum, output).

A tile is BLOCK_N consecutive positions of one sequence, which may span several cache
blocks: each position's block is looked up in the sequence's block table, so a step issues
the loads of several blocks at once instead of one block's chain of dependent loads (table
entry, then keys, then values) after another. On an H200 one block per step left the decode
kernel waiting on memory latency: 6.8 us a layer at batch 1 for a 200-token context, 4.7 with
64-position tiles. The prefill kernel keeps one block a step (prefill_attention.py says why)."""

from __future__ import annotations

import triton
import triton.language as tl

TILE = 64  # key positions the decode kernel folds in per step (its BLOCK_N)


@triton.jit
def tile_offsets(table_row, key_pos, valid, d, stride_cb, stride_ct, BLOCK_SIZE: tl.constexpr):
    """Offsets [BLOCK_N, BLOCK_D] of positions `key_pos` in the paged cache (within a KV head's
    plane), through the sequence's block table row; positions outside `valid` read block 0."""
    blocks = tl.load(table_row + key_pos // BLOCK_SIZE, mask=valid, other=0)
    return blocks[:, None] * stride_cb + (key_pos % BLOCK_SIZE)[:, None] * stride_ct + d[None, :]


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
