"""Paged decode attention: one query token per row against its sequence's cached context.

One program per (row, KV head, split): it holds the query heads that share the KV head (GQA,
padded to 16 rows for tensor-core dots) and walks its share of the row's blocks through the
block table, with an online softmax. A long context is split over several programs (flash-
decoding), so that a few long sequences still fill the GPU: each split writes its partial
output and log-sum-exp, and a second kernel combines them. With one split the first kernel
writes the output itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.gpu.online_softmax import (
    TILE,
    attend_block,
    attend_int8_lanes,
    load_query_lanes,
    store_lanes,
    tile_rows,
)


@triton.jit
def _decode_kernel(
    q_ptr, cache_ptr, tables_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr,
    scale, blocks_per_split,
    stride_qt, stride_qh,
    stride_cp, stride_ch, stride_cb, stride_ct,
    stride_tt,
    stride_ot, stride_oh,
    stride_pt, stride_ph, stride_ps,
    stride_lt, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, INT8: tl.constexpr,
    LANES: tl.constexpr, PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(lens_ptr + row)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(context, BLOCK_SIZE))

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g
    q_rows = q_ptr + row * stride_qt + heads[:, None] * stride_qh
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    keys = cache_ptr + kv_head * stride_ch
    values = keys + stride_cp
    end = tl.minimum(last * BLOCK_SIZE, context)  # this split's positions: [first, last) blocks
    if LANES:  # an int8 cache, read a word at a time in four lanes (online_softmax.py)
        w = tl.arange(0, BLOCK_D // 4)
        lane_mask = (g[:, None] < GROUP) & (4 * w[None, :] < HEAD_DIM)
        q0, q1, q2, q3 = load_query_lanes(q_rows, w, lane_mask)
        a0 = tl.zeros([BLOCK_G, BLOCK_D // 4], tl.float32)
        a1 = tl.zeros([BLOCK_G, BLOCK_D // 4], tl.float32)
        a2 = tl.zeros([BLOCK_G, BLOCK_D // 4], tl.float32)
        a3 = tl.zeros([BLOCK_G, BLOCK_D // 4], tl.float32)
        for start in range(first * BLOCK_SIZE, end, BLOCK_N):
            key_pos = start + n
            valid = key_pos < end
            rows = tile_rows(tables_ptr + row * stride_tt, key_pos, valid, stride_cb, stride_ct, BLOCK_SIZE)
            m, total, a0, a1, a2, a3 = attend_int8_lanes(q0, q1, q2, q3, keys, values, rows, valid, w,
                                                         valid[None, :], scale, m, total, a0, a1, a2, a3,
                                                         HEAD_DIM, PRECISION)
        seen = total > 0  # a split past the row's context saw nothing
        norm = tl.where(seen, total, 1.0)[:, None]
        if SPLIT:
            store_lanes(part_ptr + row * stride_pt + heads[:, None] * stride_ph + split * stride_ps, w, lane_mask,
                        a0 / norm, a1 / norm, a2 / norm, a3 / norm)
        else:
            store_lanes(out_ptr + row * stride_ot + heads[:, None] * stride_oh, w, lane_mask,
                        a0 / norm, a1 / norm, a2 / norm, a3 / norm)
    else:
        q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
        q = tl.load(q_rows + d[None, :], mask=q_mask, other=0.0)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(first * BLOCK_SIZE, end, BLOCK_N):
            key_pos = start + n
            valid = key_pos < end
            rows = tile_rows(tables_ptr + row * stride_tt, key_pos, valid, stride_cb, stride_ct, BLOCK_SIZE)
            m, total, acc = attend_block(q, keys, values, rows, valid, d, valid[None, :], scale, m, total, acc,
                                         HEAD_DIM, BLOCK_D, INT8, PRECISION)
        seen = total > 0  # a split past the row's context saw nothing
        out = acc / tl.where(seen, total, 1.0)[:, None]
        if SPLIT:
            part = part_ptr + row * stride_pt + heads[:, None] * stride_ph + split * stride_ps + d[None, :]
            tl.store(part, out, mask=q_mask)
        else:
            dst = out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :]
            tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    if SPLIT:
        lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
        tl.store(lse_ptr + row * stride_lt + heads * stride_lh + split, lse, mask=g < GROUP)


@triton.jit
def _combine_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + row * stride_lt + head * stride_lh + s, mask=s < num_splits, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a padded row (context 0): no split saw a key
    weights = tl.exp(lse - top)
    weights = weights / tl.maximum(tl.sum(weights, 0), 1e-30)  # ... and its output is zeros
    mask = (s[:, None] < num_splits) & (d[None, :] < HEAD_DIM)
    parts = tl.load(part_ptr + row * stride_pt + head * stride_ph + s[:, None] * stride_ps + d[None, :],
                    mask=mask, other=0.0)
    out = tl.sum(parts * weights[:, None], 0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def int8_lanes_fit(head_dim: int, block_d: int) -> bool:
    """Whether an int8 cache's rows of this head size are read in lanes (attend_int8_lanes):
    lanes of 16+ values, the least a dot takes (a head of 64 or more)."""
    return block_d // 4 >= 16


def decode_splits(rows: int, kv_heads: int, max_blocks: int, target_programs: int) -> int:
    """How many programs share one row's blocks: enough that rows × KV heads × splits reaches
    `target_programs` (a few per SM), but at least 4 blocks each, and at most 64 splits."""
    if max_blocks <= 4:
        return 1
    wanted = -(-target_programs // max(1, rows * kv_heads))
    return max(1, min(wanted, max_blocks // 4, 64))


def paged_decode_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, max_context_len: int, scale: float, num_splits: int = 1,
    int8_lanes: bool = True,
) -> torch.Tensor:
    """query [rows, heads, head_dim] → out (same shape); row i attends to context_lens[i]
    tokens found through block_tables[i] in kv_cache [2, kv_heads, blocks, block_size, width]
    (width: head_dim, or head_dim + 4 for an int8 cache, whose rows the query must already be
    rotated for)."""
    rows, heads, head_dim = query.shape
    kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
    group = heads // kv_heads
    out = torch.empty_like(query)
    if rows == 0:
        return out
    max_blocks = -(-max_context_len // block_size)
    num_splits = max(1, min(num_splits, max_blocks))
    blocks_per_split = -(-max_blocks // num_splits)
    num_splits = -(-max_blocks // blocks_per_split)
    split = num_splits > 1
    if split:
        part = torch.empty(rows, heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        lse = torch.empty(rows, heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part = lse = out  # unused
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_kernel[(rows, kv_heads, num_splits)](
        query, kv_cache, block_tables, context_lens, out, part, lse,
        scale, blocks_per_split,
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        part.stride(0), part.stride(1), part.stride(2) if split else 0,
        lse.stride(0), lse.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=TILE, SPLIT=split, INT8=kv_cache.dtype == torch.uint8,
        LANES=int8_lanes and kv_cache.dtype == torch.uint8 and int8_lanes_fit(head_dim, block_d),
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    if split:
        _combine_kernel[(rows, heads)](
            part, lse, out, num_splits,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        )
    return out
