"""RMSNorm computed in fp32 and cast back, exactly as transformers does it.

In bf16 that formula is eight torch ops; with the C pass attached (attach_layer_ops) it is one
call with the same roundings (tandem/kernels/layer_ops.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.layer_ops import LayerOpsKernel


class RMSNorm(nn.Module):
    ops: LayerOpsKernel | None = None

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel, bit-identical to the formula below in fp32 and a third of
            # its cost at decode sizes, where per-op dispatch dominates.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if self.ops is not None and self.ops.takes_norm(x, self.weight):
            return self.ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
