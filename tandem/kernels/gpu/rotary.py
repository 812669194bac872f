"""The rotary embedding (rotate-half form) in place, one kernel for a step's queries and keys.

Torch's formula, `cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`, is seven kernels a layer;
at batch 1 each is a few microseconds of launch and tail for almost no work, which adds up to
about a tenth of an 8B model's decode step on an H200. This kernel does it in one pass with
torch's roundings: each product rounded to the input dtype, then the difference and the sum
(no-ops in fp32). Compiled with FP fusion off: left on, the compiler folds one product into
the difference as a bf16 FMA (seen in the PTX for sm_90 and on an H200), one rounding fewer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, stride_xt, stride_ct, heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < heads) & (d[None, :] < HALF)
    first = x_ptr + token * stride_xt + h[:, None] * (2 * HALF) + d[None, :]
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_ct + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * stride_ct + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    low = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    high = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first, low.to(dtype), mask=mask)
    tl.store(first + HALF, high.to(dtype), mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, dim] (dense heads, any token stride) in place by the cos/sin rows
    [T, ..., dim / 2] of each token; returns x."""
    tokens, heads, dim = x.shape
    if tokens:
        block_h = min(triton.next_power_of_2(heads), 64)
        _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
            x, cos, sin, x.stride(0), cos.stride(0), heads,
            HALF=dim // 2, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(dim // 2),
            enable_fp_fusion=False,  # keep each rounding: no product folded into an FMA
        )
    return x


class TritonRotary:
    """`RotaryEmbedding`'s pass on a GPU (tandem/layers/rotary.py `RotaryPass`)."""

    @staticmethod
    def takes_rotary(x: torch.Tensor, cos: torch.Tensor) -> bool:
        from tandem.kernels.gpu import available

        return (x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.shape[2] % 2 == 0
                and cos.dtype == x.dtype and cos.shape[-1] == x.shape[2] // 2
                and cos.stride(-1) == 1 and cos.stride(0) == cos.shape[-1] and cos.is_contiguous()
                and available(x.device.type) is None)

    @staticmethod
    def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotary_(x, cos, sin.contiguous())
