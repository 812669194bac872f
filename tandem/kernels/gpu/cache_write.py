"""The KV write: this step's keys and values into their slots of the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slots_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cp, stride_ch, stride_cb, stride_ct,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    slots = tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot  # a negative slot is padding
    mask = (heads[:, None] < KV_HEADS) & (dims[None, :] < HEAD_DIM) & (slots >= 0)
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    where = heads[:, None] * stride_ch + block * stride_cb + offset * stride_ct + dims[None, :]
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
