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
class SmallStepWeights:
    """A second copy of every weight matrix, read by steps of at most `max_tokens` tokens.

    A step of one or two tokens is a GEMV bound by weight bandwidth, not a GEMM, and the
    best storage for it differs from the best for large batches. Measured on this 2-core
    AVX-512 CPU over the default model's matrices: fp32 [out, in] (what F.linear reads)
    43 ms per token step, fp32 stored transposed [in, out] 30 ms, bf16 19 ms, fp16 10 ms;
    at 64 tokens fp32 either way 148 ms, bf16 71 ms, fp16 435 ms (no native fp16 GEMM).
    So fp32 copies are stored transposed (same arithmetic, faster kernel), half-precision
    copies are stored as is. Activations and the KV cache stay in the run dtype, so a step
    can switch copies without touching the cache.
    """

    max_tokens: int
    dtype: torch.dtype

    @property
    def transposed(self) -> bool:
        return self.dtype == torch.float32


class SmallStepCopy:
    """Mixin for layers with `weight` (and `bias`): use the small-step copy when it applies."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    small_step: SmallStepWeights | None = None

    def attach_small_step_weights(self, plan: SmallStepWeights) -> int:
        """Make the copy; returns the bytes it adds."""
        weight = self.weight.detach().to(plan.dtype)
        self.small_weight = (weight.t() if plan.transposed else weight).contiguous()
        bias = getattr(self, "bias", None)
        self.small_bias = None if bias is None else bias.detach().to(plan.dtype)
        self.small_step = plan
        return self.small_weight.numel() * self.small_weight.element_size()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.small_step
        if plan is None or x.shape[0] > plan.max_tokens:
            return F.linear(x, self.weight, getattr(self, "bias", None))
        x_small = x.to(plan.dtype)
        if plan.transposed:
            out = torch.matmul(x_small, self.small_weight)
            if self.small_bias is not None:
                out = out + self.small_bias
        else:
            out = F.linear(x_small, self.small_weight, self.small_bias)
        return out.to(x.dtype)


def attach_small_step_weights(model: nn.Module, plan: SmallStepWeights) -> int:
    """Give every linear layer and the LM head a small-step copy; returns the bytes added."""
    return sum(m.attach_small_step_weights(plan) for m in model.modules() if isinstance(m, SmallStepCopy))


class Linear(SmallStepCopy, nn.Module):
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
