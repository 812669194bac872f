"""The int8 cache's rotation of a query and of an attention output, one kernel each.

An int8 cache stores each row rotated by a Hadamard matrix (kernels/kv_format.py), so the
attention backend rotates the query the same way before the kernels read the cache (q . k =
Rq . Rk) and the output, a weighted sum of rotated values, back after (R is its own inverse).
In torch that is a widening, a reshape copy of a strided query, a matmul and a narrowing, on
each side: about seven small kernels a layer, part of the ~0.8 ms an int8 batch-1 step of an
8B model spent over a bf16 one's on an H200. Here each side is one kernel: every (token, head)
row's runs of `rotation_size` values times the matrix in fp32 (a tensor-core dot at full fp32
precision), rounded once to the rows' dtype, as `rotate_rows(x.float()).to(x.dtype)` gives
them (the sums in another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.kv_format import hadamard, rotation_size


@triton.jit
def _rotate_kernel(
    x_ptr, out_ptr, hadamard_ptr, stride_xt, stride_xh, stride_ot, stride_oh,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, ROT: tl.constexpr,
):
    token = tl.program_id(0)
    RUNS: tl.constexpr = HEAD_DIM // ROT
    r = tl.arange(0, BLOCK_H * RUNS)  # one line a run: head r // RUNS, run r % RUNS
    j = tl.arange(0, ROT)
    head = tl.program_id(1) * BLOCK_H + r // RUNS
    run = r % RUNS
    mask = (head[:, None] < HEADS) & (j[None, :] < ROT)
    x = tl.load(x_ptr + token * stride_xt + head[:, None] * stride_xh + (run * ROT)[:, None] + j[None, :],
                mask=mask, other=0.0).to(tl.float32)
    rotation = tl.load(hadamard_ptr + j[:, None] * ROT + j[None, :])
    y = tl.dot(x, rotation, input_precision="ieee")
    tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + (run * ROT)[:, None] + j[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask)


def fused_rotation(head_dim: int) -> bool:
    """Whether `rotate_heads` takes rows of this head size: runs of 16 or more values (a dot's
    least), a power-of-two number of them, at most 16 a row (else the caller rotates in torch)."""
    size = rotation_size(head_dim)
    return size >= 16 and (head_dim // size) & (head_dim // size - 1) == 0 and head_dim // size <= 16


def rotate_heads(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] (each row's last dimension dense; tokens and heads may be
    strided, as a query split from the fused qkv projection is) -> a new contiguous tensor of
    x's dtype, each run of `rotation_size(head_dim)` values rotated."""
    tokens, heads, head_dim = x.shape
    out = torch.empty(tokens, heads, head_dim, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    assert x.stride(2) == 1 and fused_rotation(head_dim)
    size = rotation_size(head_dim)
    runs = head_dim // size
    # A program a token and group of heads, each group the dot's least (16 runs): at batch 1 one
    # program rotating all of an 8B's 32 heads took 5.2 us on an H200.
    block_h = max(16 // runs, 1)
    _rotate_kernel[(tokens, triton.cdiv(heads, block_h))](
        x, out, hadamard(size, torch.float32, x.device), x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        HEADS=heads, HEAD_DIM=head_dim, BLOCK_H=block_h, ROT=size,
    )
    return out
