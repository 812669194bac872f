"""Linear layers that know how to load their checkpoint shards.

Projections that read the same input are merged into one matrix (q/k/v, gate/up) so a step
issues one GEMM instead of three; each checkpoint tensor is copied into its row range.
Tensor-parallel variants will shard these along the same row ranges.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

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
