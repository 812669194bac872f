"""One step of attention with an online softmax, shared by the decode and prefill kernels:
a tile of keys and values from the paged cache folded into running (max, sum, output).

A tile is BLOCK_N consecutive positions of one sequence, which may span several cache
blocks: each position's block is looked up in the sequence's block table, so a step issues
the loads of several blocks at once instead of one block's chain of dependent loads (table
entry, then keys, then values) after another. On an H200 one block per step left the decode
kernel waiting on memory latency: 6.8 us a layer at batch 1 for a 200-token context, 4.7 with
64-position tiles. The prefill kernel keeps one block a step (prefill_attention.py says why).

Under --kv-cache-dtype int8 a cached row is `HEAD_DIM` int8 values and their fp32 scale
(tandem/kernels/kv_format.py): the tile's values are widened and multiplied by their row's
scale as they are loaded. The rows are stored Hadamard-rotated; the caller rotates the query
and the output (q.k = Rq.Rk, and the output is a weighted sum of rotated values), so the
kernels never rotate."""

from __future__ import annotations

import triton
import triton.language as tl

TILE = 64  # key positions the decode kernel folds in per step (its BLOCK_N)


@triton.jit
def tile_rows(table_row, key_pos, valid, stride_cb, stride_ct, BLOCK_SIZE: tl.constexpr):
    """Offsets [BLOCK_N] of the rows of positions `key_pos` in the paged cache (within a KV
    head's plane), through the sequence's block table row; positions outside `valid` read
    block 0."""
    blocks = tl.load(table_row + key_pos // BLOCK_SIZE, mask=valid, other=0)
    return blocks * stride_cb + (key_pos % BLOCK_SIZE) * stride_ct


@triton.jit
def load_rows(plane, rows, row_mask, d, HEAD_DIM: tl.constexpr, INT8: tl.constexpr, dtype: tl.constexpr):
    """The cached rows at offsets `rows` [N] of a plane as [N, BLOCK_D] in `dtype` (rows outside
    `row_mask` and columns past HEAD_DIM read as zeros): as stored, or, from an int8 cache, the
    values times the fp32 scale that follows them in the row."""
    mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    where = plane + rows[:, None] + d[None, :]
    if INT8:
        x = tl.load(where, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        scales = tl.load((plane + rows + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=row_mask, other=0.0)
        return (x * scales[:, None]).to(dtype)
    return tl.load(where, mask=mask, other=0.0).to(dtype)


@triton.jit
def attend_block(q, keys, values, rows, row_mask, d, visible, scale, m, total, acc,
                 HEAD_DIM: tl.constexpr, INT8: tl.constexpr, PRECISION: tl.constexpr):
    """q [rows, dim] against the keys of the cached rows at offsets `rows` (those outside
    `row_mask` read as zeros), scores outside `visible` dropped; returns the new (m, total,
    acc)."""
    k = load_rows(keys, rows, row_mask, d, HEAD_DIM, INT8, q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    total = total * alpha + tl.sum(p, 1)
    v = load_rows(values, rows, row_mask, d, HEAD_DIM, INT8, q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    return m_new, total, acc
