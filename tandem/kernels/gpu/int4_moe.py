"""W4A16 grouped GEMM for INT4 MoE experts: `out[rows of e] = x[rows of e] @ W_e^T` for every
expert e of a layer in one launch, the weights read as packed nibbles.

The weights stay in `compressed-tensors`' pack-quantized layout (Kimi K2.5's routed experts:
symmetric INT4, group size 32), stacked over the layer's experts:

- `packed` int32 [E, N, K/8]: word w of row n holds inputs 8w..8w+7, input 8w+j in bits
  4j..4j+3 (lowest nibble first), as the unsigned level q + 8 of the signed value q in
  [-8, 7]. Checked against compressed-tensors 0.20's `pack_to_int32` / `unpack_from_int32`
  (element i at bit 4i, offset 8), and by tests/kernels/gpu/test_int4_moe.py;
- `scales` [E, N, K/32] (bf16 or fp16): W_e[n, k] = (level - 8) * scales[e, n, k // 32].

The activations come sorted by expert: x [M, K], expert e's rows x[offsets[e]:offsets[e+1]]
(an expert may have none). One program computes a tile of BLOCK_M rows of one expert by
BLOCK_N outputs: it unpacks each [BLOCK_N, BLOCK_K] weight tile in registers (never a
dequantized matrix in memory), scales it per group of 32 inputs in fp32, rounds it to x's
dtype and multiplies on the tensor cores with fp32 accumulation. The product is computed as
out^T = W x^T ("swap AB"): the weight tile, the big operand, is the dot's left side, so the
rows (1 to 64 per expert when decoding) are the narrow side. With every expert's rows in one
row tile (BLOCK_M >= the most rows any expert has: `max_rows` below), each expert's packed
bytes are read once per launch.

The grid: the N tiles, then the row tiles of all experts together (each program finds its
expert by a prefix sum over `expert_offsets` on the device, so the grid depends only on M,
E and the block sizes, and a CUDA graph can capture it), then splits of K. The row-tile axis
is sized for the worst case, `(M + min(E, M) * (BLOCK_M - 1)) // BLOCK_M` (every non-empty
expert's last tile partial); programs past the real tiles do nothing. With `split_k` > 1
each program sums its share of K into an fp32 workspace and a second kernel adds the shares
(in a fixed order: no atomics, the same output every run) - for decode, where a few experts
times N / BLOCK_N programs would leave most SMs idle.

`silu_mul=True` fuses the gated MLP's middle for w13 stacked as [E, 2I, K] (gate rows, then
up rows): each program computes the same BLOCK_N columns of gate and up and writes
silu(gate) * up [M, I], with the roundings of the unfused path (the GEMM's outputs rounded to
x's dtype, then `silu_mul.py`'s): the sums and roundings of `silu_mul(int4_moe_gemm(...))`.

Rows outside [offsets[0], offsets[E]) (a CUDA graph's padding) are neither computed nor
written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP_SIZE = 32  # inputs per scale
PACK = 8  # nibbles per int32 word


@triton.jit
def _int4_moe_kernel(
    x_ptr, offsets_ptr, packed_ptr, scales_ptr, out_ptr, part_ptr,
    num_experts, N, K, k_per_split,
    stride_xm,
    stride_pe, stride_pn,
    stride_se, stride_sn,
    stride_om,
    stride_ws, stride_wm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    SILU: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)

    # Which expert, and which of its row tiles: a prefix sum of the experts' tile counts.
    e = tl.arange(0, BLOCK_E)
    starts = tl.load(offsets_ptr + e, mask=e < num_experts, other=0)
    ends = tl.load(offsets_ptr + e + 1, mask=e < num_experts, other=0)
    tiles = tl.cdiv(ends - starts, BLOCK_M)
    last = tl.cumsum(tiles, 0)  # one past each expert's last tile
    expert = tl.sum((last <= tile).to(tl.int32), 0)
    mine = e == expert
    first_tile = tl.sum(tl.where(mine, last - tiles, 0), 0)
    row_start = tl.sum(tl.where(mine, starts, 0), 0) + (tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(mine, ends, 0), 0)  # 0 past the last expert: no rows
    expert = tl.minimum(expert, num_experts - 1)  # a program with no rows still forms addresses

    width = N // 2 if SILU else N  # SILU: n < width are gate columns, width + n their up
    m = row_start + tl.arange(0, BLOCK_M)
    m_mask = m < row_end
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < width
    words = tl.arange(0, BLOCK_K // 8)  # the tile's int32 words along K
    shifts = tl.arange(0, 8) * 4  # input 8w + j sits in bits 4j..4j+3 of word w
    kk = tl.arange(0, BLOCK_K)

    packed = packed_ptr + expert.to(tl.int64) * stride_pe
    scales = scales_ptr + expert.to(tl.int64) * stride_se
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if SILU:
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    dtype = x_ptr.dtype.element_ty

    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    k_end = tl.where(row_start < row_end, k_end, k_start)  # no rows: no loads
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + kk
        x_t = tl.load(x_ptr + m[None, :].to(tl.int64) * stride_xm + k[:, None],
                      mask=m_mask[None, :] & (k[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_M]
        w_idx = k0 // 8 + words
        w_mask = n_mask[:, None] & (w_idx[None, :] < K // 8)
        # one scale per 4 words (32 inputs); the 4 loads of each hit the same cache line
        s_idx = w_idx // 4
        w = _dequant(packed + n[:, None] * stride_pn + w_idx[None, :],
                     scales + n[:, None] * stride_sn + s_idx[None, :], w_mask, shifts, BLOCK_N, BLOCK_K, dtype)
        acc = tl.dot(w, x_t, acc, input_precision=PRECISION)
        if SILU:
            w = _dequant(packed + (n[:, None] + width) * stride_pn + w_idx[None, :],
                         scales + (n[:, None] + width) * stride_sn + s_idx[None, :], w_mask, shifts,
                         BLOCK_N, BLOCK_K, dtype)
            acc_up = tl.dot(w, x_t, acc_up, input_precision=PRECISION)

    out_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT:  # fp32 shares, [splits, M, N] (gate then up for SILU); _int4_moe_reduce adds them
        part = part_ptr + split * stride_ws + m[None, :].to(tl.int64) * stride_wm + n[:, None]
        tl.store(part, acc, mask=out_mask)
        if SILU:
            tl.store(part + width, acc_up, mask=out_mask)
    else:
        dst = out_ptr + m[None, :].to(tl.int64) * stride_om + n[:, None]
        if SILU:
            tl.store(dst, _silu_mul(acc, acc_up, out_ptr.dtype.element_ty), mask=out_mask)
        else:
            tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _dequant(word_ptrs, scale_ptrs, mask, shifts, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             dtype: tl.constexpr):
    """[BLOCK_N, BLOCK_K / 8] packed words -> the [BLOCK_N, BLOCK_K] weights, in `dtype`."""
    packed = tl.load(word_ptrs, mask=mask, other=0)  # masked: scale 0, weight 0
    scale = tl.load(scale_ptrs, mask=mask, other=0.0).to(tl.float32)
    levels = (packed[:, :, None] >> shifts[None, None, :]) & 0xF  # [BLOCK_N, BLOCK_K / 8, 8]
    w = (levels - 8).to(tl.float32) * scale[:, :, None]
    return tl.reshape(w, [BLOCK_N, BLOCK_K]).to(dtype)


@triton.jit
def _silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up with the unfused path's roundings (tandem/kernels/gpu/silu_mul.py)."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def _int4_moe_reduce(
    part_ptr, offsets_ptr, out_ptr, num_experts, width, splits, stride_ws, stride_wm, stride_om,
    SILU: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = (row >= tl.load(offsets_ptr)) & (row < tl.load(offsets_ptr + num_experts))
    mask = c < tl.where(inside, width, 0)  # a row outside the experts': left alone
    acc = tl.zeros([BLOCK], tl.float32)
    if SILU:
        acc_up = tl.zeros([BLOCK], tl.float32)
    for s in range(0, splits):
        part = part_ptr + s * stride_ws + row * stride_wm + c
        acc += tl.load(part, mask=mask, other=0.0)
        if SILU:
            acc_up += tl.load(part + width, mask=mask, other=0.0)
    dst = out_ptr + row * stride_om + c
    if SILU:
        tl.store(dst, _silu_mul(acc, acc_up, out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weights in fp32, in torch: packed int32 [..., N, K / 8] and scales [..., N, K / 32]
    -> [..., N, K]. A reference (the bench's check on a GPU); the kernel never builds it."""
    shifts = 4 * torch.arange(PACK, device=packed.device, dtype=torch.int32)
    levels = (packed[..., None] >> shifts) & 0xF
    weights = (levels - 8).flatten(-2).float()
    return weights * scales.float().repeat_interleave(GROUP_SIZE, dim=-1)


def int4_moe_config(max_rows: int, n: int, k: int) -> dict[str, int]:
    """Block sizes and warps for experts of up to `max_rows` rows each, N outputs, K inputs.

    First guesses, not yet timed on a GPU (`tandem bench gpu --int4-moe` measures them): one
    row tile per expert up to 64 rows (the decode case: each expert's weights read once), 64
    rows a tile past that (prefill: the weights re-read per row tile, from L2). Eight warps:
    with four, ptxas (sm_90) gave the decode tiles 231-255 registers a thread and spilled the
    fused 64-row one; with eight, 120-240 and no spills (cuobjdump on the sm_90 cubins; every
    tile's dot a wgmma)."""
    block_m = min(64, max(16, triton.next_power_of_2(max(1, max_rows))))
    block_n = min(128 if max_rows > 64 else 64, max(16, triton.next_power_of_2(n)))
    block_k = min(128 if max_rows <= 16 else 64, max(32, triton.next_power_of_2(k)))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 8,
            "num_stages": 4 if block_m <= 32 else 3}


def row_tiles(rows: int, experts: int, block_m: int) -> int:
    """The row-tile axis of the grid: the most tiles `rows` rows over `experts` experts can
    need (each non-empty expert's last tile partial), without looking at how they split."""
    return (rows + min(experts, rows) * (block_m - 1)) // block_m


def int4_moe_splits(programs: int, k: int, block_k: int, target_programs: int) -> int:
    """How many programs share one tile's K: enough that `programs` (the unsplit grid) times
    the splits reaches `target_programs` (a few per SM), at least 8 BLOCK_K steps each, and
    at most 16."""
    steps = -(-k // block_k)
    if programs >= target_programs or steps < 16:
        return 1
    return max(1, min(-(-target_programs // max(1, programs)), steps // 8, 16))


def int4_moe_gemm(
    x: torch.Tensor, expert_offsets: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, *,
    silu_mul: bool = False, max_rows: int | None = None, split_k: int | None = None,
    out: torch.Tensor | None = None, config: dict[str, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, sorted by expert: expert e's rows are
    x[expert_offsets[e]:expert_offsets[e + 1]]), expert_offsets int32 [E + 1] on x's device,
    packed int32 [E, N, K / 8], scales [E, N, K / 32] -> out [M, N] in x's dtype, fp32
    accumulation; with `silu_mul`, N = 2I (gate rows then up rows) -> silu(gate) * up [M, I].

    `max_rows`: the most rows any one expert has, as the host knows it (the routing's counts,
    or the batch size in a CUDA graph); it only picks the row tile (one tile per expert up to
    64 rows), the output is right whatever it says. Default M.
    `split_k`: programs per tile along K; default: enough to give every SM a few programs
    when the grid is small (decode), 1 otherwise. `out`: where to write (else allocated).
    `config`: block sizes and warps, as `int4_moe_config` gives them (its choice by default).
    """
    rows, k = x.shape
    experts, n, words = packed.shape
    assert k % GROUP_SIZE == 0 and words * PACK == k, f"K={k}: packed {tuple(packed.shape)} needs K / 8 words"
    assert scales.shape == (experts, n, k // GROUP_SIZE), f"scales {tuple(scales.shape)}"
    assert expert_offsets.shape == (experts + 1,) and expert_offsets.dtype == torch.int32
    assert x.stride(1) == 1 and packed.stride(2) == 1 and scales.stride(2) == 1
    assert not silu_mul or n % 2 == 0
    width = n // 2 if silu_mul else n
    if out is None:
        out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    assert out.shape == (rows, width) and out.stride(1) == 1 and out.dtype == x.dtype
    if rows == 0 or experts == 0:
        return out
    if config is None:
        config = int4_moe_config(rows if max_rows is None else max_rows, width, k)
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    grid_n, grid_m = triton.cdiv(width, block_n), row_tiles(rows, experts, block_m)
    if split_k is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        split_k = int4_moe_splits(grid_n * grid_m, k, block_k, 4 * sms)
    steps = triton.cdiv(k, block_k)
    split_k = max(1, min(split_k, steps))
    k_per_split = triton.cdiv(steps, split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    split = split_k > 1
    part = torch.empty(split_k, rows, n, dtype=torch.float32, device=x.device) if split else out
    _int4_moe_kernel[(grid_n, grid_m, split_k)](
        x, expert_offsets, packed, scales, out, part,
        experts, n, k, k_per_split,
        x.stride(0),
        packed.stride(0), packed.stride(1),
        scales.stride(0), scales.stride(1),
        out.stride(0),
        part.stride(0) if split else 0, part.stride(1) if split else 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=triton.next_power_of_2(experts),
        SILU=silu_mul, SPLIT=split, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    if split:
        block = min(1024, triton.next_power_of_2(width))
        _int4_moe_reduce[(rows, triton.cdiv(width, block))](
            part, expert_offsets, out, experts, width, split_k, part.stride(0), part.stride(1), out.stride(0),
            SILU=silu_mul, BLOCK=block)
    return out
