"""The gated MLP's middle, `silu(gate) * up`, in one kernel instead of two.

gate_up [T, 2 * I] (gate then up, as the merged projection writes them) -> [T, I], with
torch's roundings: silu computed in fp32 and rounded to the input dtype, then the product
rounded again (no-ops in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_g, stride_o, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < width
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_g + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_g + width + c, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (silu * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, double = gate_up.shape
    width = double // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(width, BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=BLOCK)
    return out


class TritonSiluMul:
    """`GateUpLinear`'s pass on a GPU (tandem/layers/linear.py `SiluMulPass`)."""

    every_step = True

    @staticmethod
    def takes_silu_mul(gate_up: torch.Tensor) -> bool:
        from tandem.kernels.gpu import available

        return (gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
                and available(gate_up.device.type) is None)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)
