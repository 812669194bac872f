"""The KV write: this step's keys and values into their slots of the paged cache; into an
int8 or fp8 cache, rounded to its rows or bytes in the same kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.kv_format import hadamard, rotation_size


@triton.jit
def _step_rows(key_ptr, value_ptr, slots_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_ch, stride_cb,
               stride_ct, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """This program's token's keys and values [BLOCK_H, BLOCK_D] as the step holds them, where
    they go in a plane of the cache, and which of them to store (none for a negative slot:
    padding)."""
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    slots = tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot
    mask = (heads[:, None] < KV_HEADS) & (dims[None, :] < HEAD_DIM) & (slots >= 0)
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    where = heads[:, None] * stride_ch + block * stride_cb + offset * stride_ct + dims[None, :]
    return k, v, where, mask


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slots_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cp, stride_ch, stride_cb, stride_ct,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    k, v, where, mask = _step_rows(key_ptr, value_ptr, slots_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                                   stride_ch, stride_cb, stride_ct, KV_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D, BLOCK_SIZE)
    tl.store(cache_ptr + where, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + stride_cp + where, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key, value [T, kv_heads, head_dim] (last dim dense) into kv_cache
    [2, kv_heads, blocks, block_size, head_dim] at slot_mapping [T] (block * block_size +
    offset; a negative slot is skipped)."""
    tokens, kv_heads, head_dim = key.shape
    if tokens == 0:
        return
    assert key.stride(2) == value.stride(2) == kv_cache.stride(4) == 1
    _write_kv_kernel[(tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=kv_cache.shape[3],
    )


@triton.jit
def _fp8_bytes(x):
    """fp32 values as float8 e4m3 bytes, as torch's clamp(-448, 448) then cast rounds them: to
    nearest, ties to even, past 448 saturated, NaN kept NaN. In integer arithmetic on the
    fp32's bits, not Triton's float8 cast: the CPU interpreter (CI) rounds some values just
    under a power of two down a whole binade, and this must be the bytes a GPU stores. Below
    2^-6 the step is 2^-9 (the subnormals); above, the mantissa is rounded to three bits with
    the carry running into the exponent."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude_bits = bits & 0x7FFFFFFF
    magnitude = tl.minimum(magnitude_bits.to(tl.float32, bitcast=True), 448.0)
    m = magnitude.to(tl.int32, bitcast=True)
    normal = ((m + 0x7FFFF + ((m >> 20) & 1)) >> 20) - (120 << 3)
    small = ((magnitude * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)  # 1.5 x 2^23: ties to even
    code = tl.where(magnitude < 0.015625, small, normal)
    code = tl.where(magnitude_bits > 0x7F800000, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _write_kv_fp8_kernel(
    key_ptr, value_ptr, cache_ptr, slots_ptr, key_multiplier, value_multiplier,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cp, stride_ch, stride_cb, stride_ct,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    k, v, where, mask = _step_rows(key_ptr, value_ptr, slots_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                                   stride_ch, stride_cb, stride_ct, KV_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D, BLOCK_SIZE)
    tl.store(cache_ptr + where, _fp8_bytes(k.to(tl.float32) * key_multiplier), mask=mask)
    tl.store(cache_ptr + stride_cp + where, _fp8_bytes(v.to(tl.float32) * value_multiplier), mask=mask)


def write_kv_fp8(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 key_multiplier: float = 1.0, value_multiplier: float = 1.0) -> None:
    """key, value [T, kv_heads, head_dim] in a float dtype, times their multipliers (one over
    the layer's power-of-two scales: exact), rounded to float8 e4m3 and stored into the fp8
    kv_cache [2, kv_heads, blocks, block_size, head_dim] at slot_mapping [T], in one kernel:
    the division, clamp and cast were six torch kernels a layer, ~0.4 ms of an 8B model's
    batch-1 step on an H200."""
    tokens, kv_heads, head_dim = key.shape
    if tokens == 0:
        return
    assert key.stride(2) == value.stride(2) == kv_cache.stride(4) == 1 and kv_cache.dtype == torch.float8_e4m3fn
    cache = kv_cache.view(torch.uint8)
    _write_kv_fp8_kernel[(tokens,)](
        key, value, cache, slot_mapping, float(key_multiplier), float(value_multiplier),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=kv_cache.shape[3],
    )


@triton.jit
def _round_int8_rows(src, stride_t, stride_h, token, plane, hadamard_ptr, slot_offset, slot,
                     stride_ch, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     ROT: tl.constexpr):
    """One token's rows of one plane (keys or values) rounded to int8 rows and stored at
    `slot_offset` (kv_format.quantize_rows' arithmetic: each run of ROT values times the
    normalized Hadamard matrix, the row's absolute maximum to 127, to nearest even)."""
    RUNS: tl.constexpr = HEAD_DIM // ROT
    r = tl.arange(0, BLOCK_H * RUNS)  # one line a run: head r // RUNS, run r % RUNS
    j = tl.arange(0, ROT)
    head = r // RUNS
    run = r % RUNS
    slots = tl.zeros([BLOCK_H * RUNS, ROT], tl.int64) + slot  # a negative slot is padding
    mask = (head[:, None] < KV_HEADS) & (j[None, :] < ROT) & (slots >= 0)
    x = tl.load(src + token * stride_t + head[:, None] * stride_h + (run * ROT)[:, None] + j[None, :],
                mask=mask, other=0.0).to(tl.float32)
    rotation = tl.load(hadamard_ptr + j[:, None] * ROT + j[None, :])
    y = tl.dot(x, rotation, input_precision="ieee")
    top = tl.max(tl.reshape(tl.max(tl.abs(y), 1), [BLOCK_H, RUNS]), 1)  # a head's row maximum
    inverse = tl.where(top > 0, 127.0 / tl.where(top > 0, top, 1.0), 0.0)
    inverse_runs = tl.reshape(tl.broadcast_to(inverse[:, None], [BLOCK_H, RUNS]), [BLOCK_H * RUNS])
    scaled = y * inverse_runs[:, None]
    rounded = (scaled + 12582912.0) - 12582912.0  # 1.5 x 2^23: to the nearest integer, ties to even
    levels = tl.minimum(tl.maximum(rounded, -127.0), 127.0).to(tl.int8).to(tl.uint8, bitcast=True)
    rows = plane + slot_offset + head * stride_ch
    tl.store(rows[:, None] + (run * ROT)[:, None] + j[None, :], levels, mask=mask)
    heads = tl.arange(0, BLOCK_H)
    scales = plane + slot_offset + heads * stride_ch + HEAD_DIM
    head_slots = tl.zeros([BLOCK_H], tl.int64) + slot
    tl.store(scales.to(tl.pointer_type(tl.float32)), top / 127.0, mask=(heads < KV_HEADS) & (head_slots >= 0))


@triton.jit
def _write_kv_int8_kernel(
    key_ptr, value_ptr, cache_ptr, slots_ptr, hadamard_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cp, stride_ch, stride_cb, stride_ct,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, ROT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    slot_offset = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
    _round_int8_rows(key_ptr, stride_kt, stride_kh, token, cache_ptr, hadamard_ptr, slot_offset, slot,
                     stride_ch, KV_HEADS, HEAD_DIM, BLOCK_H, ROT)
    _round_int8_rows(value_ptr, stride_vt, stride_vh, token, cache_ptr + stride_cp, hadamard_ptr, slot_offset,
                     slot, stride_ch, KV_HEADS, HEAD_DIM, BLOCK_H, ROT)


def fused_int8_write(head_dim: int) -> bool:
    """Whether write_kv_int8 rounds rows of this head size: its rotation is a tensor-core dot of
    runs of 16 or more values, in a power-of-two number of runs a row (else the caller rounds
    them in torch, kv_format.quantize_rows, and stores the bytes)."""
    size = rotation_size(head_dim)
    return size >= 16 and (head_dim // size) & (head_dim // size - 1) == 0 and head_dim // size <= 16


def write_kv_int8(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """key, value [T, kv_heads, head_dim] in a float dtype, rounded to int8 rows (values and
    their fp32 scale) and stored into the uint8 kv_cache [2, kv_heads, blocks, block_size,
    head_dim + 4] at slot_mapping [T], in one kernel: the rotation, the scale and the rounding
    of kv_format.quantize_rows (the rotation's sums in another order, so a value can land one
    level apart), not a dozen torch kernels a layer."""
    tokens, kv_heads, head_dim = key.shape
    if tokens == 0:
        return
    assert key.stride(2) == value.stride(2) == kv_cache.stride(4) == 1 and fused_int8_write(head_dim)
    size = rotation_size(head_dim)
    runs = head_dim // size
    _write_kv_int8_kernel[(tokens,)](
        key, value, kv_cache, slot_mapping, hadamard(size, torch.float32, key.device),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=max(triton.next_power_of_2(kv_heads), 16 // runs),
        ROT=size, BLOCK_SIZE=kv_cache.shape[3],
    )
