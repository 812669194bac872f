"""One step of attention with an online softmax, shared by the decode and prefill kernels:
a tile of keys and values from the paged cache folded into running (max, sum, output).

A tile is BLOCK_N consecutive positions of one sequence, which may span several cache
blocks: each position's block is looked up in the sequence's block table, so a step issues
the loads of several blocks at once instead of one block's chain of dependent loads (table
entry, then keys, then values) after another. On an H200 one block per step left the decode
kernel waiting on memory latency: 6.8 us a layer at batch 1 for a 200-token context, 4.7 with
64-position tiles. The prefill kernel keeps one block a step (prefill_attention.py says why).

Under --kv-cache-dtype int8 a cached row is `HEAD_DIM` int8 values and their fp32 scale
(tandem/kernels/kv_format.py). A row starts 4-byte aligned (HEAD_DIM + 4 bytes, HEAD_DIM a
multiple of 4: the backend refuses others), so the kernels read a tile's rows as 32-bit words,
not byte by byte. The decode kernel takes each word's four bytes as four lanes of the head
dimension (attend_int8_lanes): four dots of a query lane with a key lane make the scores, four
dots of the probabilities with a value lane the output's four lanes. The prefill kernel splits
the words into bytes in registers and makes one dot of them (load_int8_rows). Either way the
row scales multiply scores and probabilities, not values. Measured on an H200 (Llama-3.1-8B's
heads; docs/performance.md): decode over 64 rows of 2,048 tokens, a layer's kernel took 804 us
byte by byte, 535 with words split in registers, 220 in lanes (the bf16 cache's 140); the
engine's int8 prefill ran at 28,500 tok/s with words split in registers and 25,100 in lanes.
The rows are stored Hadamard-rotated; the caller rotates the query and the output (q.k =
Rq.Rk, and the output is a weighted sum of rotated values), so the kernels never rotate."""

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
    """The cached rows at offsets `rows` [N] of a float plane as [N, BLOCK_D] in `dtype` (rows
    outside `row_mask` and columns past HEAD_DIM read as zeros)."""
    mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    return tl.load(plane + rows[:, None] + d[None, :], mask=mask, other=0.0).to(dtype)


@triton.jit
def load_int8_rows(plane, rows, row_mask, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, dtype: tl.constexpr):
    """The int8 rows at offsets `rows` [N] of a plane: their values [N, BLOCK_D] in `dtype`
    (whole numbers, exact in bf16), read as 32-bit words and split into bytes in registers,
    and their fp32 scales [N] (0 outside `row_mask`)."""
    w = tl.arange(0, BLOCK_D // 4)
    words, scales = load_int8_words(plane, rows, row_mask, w, HEAD_DIM)
    shifts = 24 - 8 * tl.arange(0, 4)  # byte b of a little-endian word to the top, then back down
    values = (words[:, :, None] << shifts[None, None, :]) >> 24
    return tl.reshape(values, [rows.shape[0], BLOCK_D]).to(dtype), scales


@triton.jit
def load_int8_words(plane, rows, row_mask, w, HEAD_DIM: tl.constexpr):
    """The int8 rows at offsets `rows` [N] of a plane as 32-bit words [N, BLOCK_D / 4] (value
    4w + b is byte b of word w) and their fp32 scales [N]. A row is HEAD_DIM + 4 bytes, so it
    starts 4-byte aligned but not 16: a word a load, where bytes would take four."""
    mask = row_mask[:, None] & (4 * w[None, :] < HEAD_DIM)
    words = tl.load((plane + rows[:, None] + 4 * w[None, :]).to(tl.pointer_type(tl.int32)), mask=mask, other=0)
    scales = tl.load((plane + rows + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=row_mask, other=0.0)
    return words, scales


@triton.jit
def lane(words, b: tl.constexpr, dtype: tl.constexpr):
    """Byte b of each little-endian word, sign-extended, in `dtype`: the values 4w + b."""
    return ((words << (24 - 8 * b)) >> 24).to(dtype)


@triton.jit
def load_query_lanes(row_ptrs, w, mask):
    """The four lanes of query rows (`row_ptrs` [R, 1] at each row's first value): columns
    4w + b for b = 0..3, each [R, BLOCK_D / 4], zeros outside `mask`."""
    return (tl.load(row_ptrs + 4 * w[None, :], mask=mask, other=0.0),
            tl.load(row_ptrs + 4 * w[None, :] + 1, mask=mask, other=0.0),
            tl.load(row_ptrs + 4 * w[None, :] + 2, mask=mask, other=0.0),
            tl.load(row_ptrs + 4 * w[None, :] + 3, mask=mask, other=0.0))


@triton.jit
def store_lanes(row_ptrs, w, mask, a0, a1, a2, a3):
    """Four lanes [R, BLOCK_D / 4] back into rows' columns 4w + b, cast to the rows' dtype."""
    ty = row_ptrs.dtype.element_ty
    tl.store(row_ptrs + 4 * w[None, :], a0.to(ty), mask=mask)
    tl.store(row_ptrs + 4 * w[None, :] + 1, a1.to(ty), mask=mask)
    tl.store(row_ptrs + 4 * w[None, :] + 2, a2.to(ty), mask=mask)
    tl.store(row_ptrs + 4 * w[None, :] + 3, a3.to(ty), mask=mask)


@triton.jit
def attend_int8_lanes(q0, q1, q2, q3, keys, values, rows, row_mask, w, visible, scale, m, total,
                      a0, a1, a2, a3, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr):
    """attend_block over an int8 cache, in lanes: the tile's keys and values come in as words,
    and each of a word's four bytes is a lane of the head dimension (values 4w + b), so
    q.k is the sum of four dots of a query lane with a key lane, and the output four lanes
    (a0..a3), each a dot of the probabilities with a value lane. Nothing is reshaped or
    shuffled; the row scales multiply the scores (a key's) and the probabilities (a value's)."""
    dtype: tl.constexpr = q0.dtype
    kw, k_scales = load_int8_words(keys, rows, row_mask, w, HEAD_DIM)
    qk = tl.dot(q0, tl.trans(lane(kw, 0, dtype)), input_precision=PRECISION)
    qk = tl.dot(q1, tl.trans(lane(kw, 1, dtype)), qk, input_precision=PRECISION)
    qk = tl.dot(q2, tl.trans(lane(kw, 2, dtype)), qk, input_precision=PRECISION)
    qk = tl.dot(q3, tl.trans(lane(kw, 3, dtype)), qk, input_precision=PRECISION)
    scores = tl.where(visible, qk * (k_scales * scale)[None, :], float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    total = total * alpha + tl.sum(p, 1)
    vw, v_scales = load_int8_words(values, rows, row_mask, w, HEAD_DIM)
    pv = (p * v_scales[None, :]).to(dtype)
    a0 = tl.dot(pv, lane(vw, 0, dtype), a0 * alpha[:, None], input_precision=PRECISION)
    a1 = tl.dot(pv, lane(vw, 1, dtype), a1 * alpha[:, None], input_precision=PRECISION)
    a2 = tl.dot(pv, lane(vw, 2, dtype), a2 * alpha[:, None], input_precision=PRECISION)
    a3 = tl.dot(pv, lane(vw, 3, dtype), a3 * alpha[:, None], input_precision=PRECISION)
    return m_new, total, a0, a1, a2, a3


@triton.jit
def attend_block(q, keys, values, rows, row_mask, d, visible, scale, m, total, acc,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, INT8: tl.constexpr, PRECISION: tl.constexpr):
    """q [rows, dim] against the keys of the cached rows at offsets `rows` (those outside
    `row_mask` read as zeros), scores outside `visible` dropped; returns the new (m, total,
    acc). From an int8 cache (the prefill kernel's, or lanes too narrow for a dot) the dots take
    the rows' whole-number values, and the scales multiply the scores (a
    key's) and the probabilities (a value's) instead of every value."""
    if INT8:
        k, k_scales = load_int8_rows(keys, rows, row_mask, HEAD_DIM, BLOCK_D, q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (k_scales * scale)[None, :]
    else:
        k = load_rows(keys, rows, row_mask, d, HEAD_DIM, INT8, q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    total = total * alpha + tl.sum(p, 1)
    if INT8:
        v, v_scales = load_int8_rows(values, rows, row_mask, HEAD_DIM, BLOCK_D, q.dtype)
        acc = acc * alpha[:, None] + tl.dot((p * v_scales[None, :]).to(q.dtype), v, input_precision=PRECISION)
    else:
        v = load_rows(values, rows, row_mask, d, HEAD_DIM, INT8, q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    return m_new, total, acc
