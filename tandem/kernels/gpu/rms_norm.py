"""RMSNorm, optionally fused with the residual add before it, one program per row.

The same arithmetic as transformers' (and tandem/layers/norm.py): the sum `x + residual` is
rounded to the input dtype, normalised in fp32, rounded back, then scaled by the weight. The
fused form writes the sum into `residual` in place, as vLLM's fused_add_rms_norm does, so a
decoder layer reads each hidden state once instead of three times.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    mask = c < cols
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_r + c, mask=mask, other=0.0)
        tl.store(residual_ptr + row * stride_r + c, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / cols + eps)
    normed = (x32 * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [rows, cols] (of x + residual, stored into residual, when given)."""
    rows, cols = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    out = torch.empty_like(x)
    if rows:
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols),
        )
    return out


class TritonNorm:
    """`RMSNorm`'s pass on a GPU (tandem/layers/norm.py `NormPass`): rows whose last dimension
    is dense, in half precision (fp32 keeps torch's fused op); q/k norms' [T, heads, dim]
    go as T * heads rows."""

    @staticmethod
    def takes_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
        from tandem.kernels.gpu import available

        return (x.dtype in (torch.bfloat16, torch.float16) and x.dim() >= 2 and x.is_contiguous()
                and weight.is_contiguous() and available(x.device.type) is None)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x.view(-1, x.shape[-1]), weight, eps).view(x.shape)
