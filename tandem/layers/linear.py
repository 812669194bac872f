"""Linear layers that know how to load their checkpoint shards.

Projections that read the same input are merged into one matrix (q/k/v, gate/up) so a step
issues one GEMM instead of three; each checkpoint tensor is copied into its row range.
Tensor-parallel variants will shard these along the same row ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LowPrecisionPolicy:
    """When a layer reads its bf16 copy of the weights instead of the run-dtype original.

    Decoding a few sequences is bound by weight bandwidth, so half-size weights nearly
    double its speed; large batches are bound by matmul throughput, where this CPU's fp32
    path is faster. Activations and the KV cache stay in the run dtype either way, so a
    step may switch formats without touching the cache.
    """

    max_tokens: int
    dtype: torch.dtype = torch.bfloat16


class LowPrecisionCopy:
    """Mixin: an optional low-precision copy of `weight` (and `bias`) used for small steps."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def attach_low_precision(self, policy: LowPrecisionPolicy) -> int:
        """Make the copy; returns the bytes it adds."""
        self.policy = policy
        self.weight_lowp = self.weight.detach().to(policy.dtype).contiguous()
        bias = getattr(self, "bias", None)
        self.bias_lowp = None if bias is None else bias.detach().to(policy.dtype)
        return self.weight_lowp.numel() * self.weight_lowp.element_size()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        policy = getattr(self, "policy", None)
        if policy is not None and x.shape[0] <= policy.max_tokens:
            return F.linear(x.to(policy.dtype), self.weight_lowp, self.bias_lowp).to(x.dtype)
        return F.linear(x, self.weight, getattr(self, "bias", None))


def attach_low_precision(model: nn.Module, policy: LowPrecisionPolicy) -> int:
    """Give every linear layer and the LM head a low-precision copy; returns bytes added."""
    return sum(m.attach_low_precision(policy) for m in model.modules() if isinstance(m, LowPrecisionCopy))


class Linear(LowPrecisionCopy, nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def load(self, param_name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        target = self.weight if param_name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {param_name} this layer was built without")
        if target.shape != tensor.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs layer {tuple(target.shape)}")
        target.data.copy_(tensor)


class MergedLinear(Linear):
    """Several projections of one input stacked along the output dimension."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]

    def load(self, param_name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if shard is None:
            return super().load(param_name, tensor)
        target = self.weight if param_name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {param_name} this layer was built without")
        rows = target.data.narrow(0, self.offsets[shard], self.out_sizes[shard])
        if rows.shape != tensor.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs shard {tuple(rows.shape)}")
        rows.copy_(tensor)
