"""Mixture-of-experts MLP: route each token to its top-k experts, run every expert once on
the tokens it received, and combine.

Routing is a pure function of the router logits (`route`), one form per family:
* softmax (Mixtral, Qwen3-MoE): softmax over all experts, top-k, the k weights renormalised
  (always for Mixtral; if `norm_topk_prob` for Qwen3-MoE);
* sigmoid, group-limited (DeepSeek-V3, Kimi-K2): sigmoid scores; a learned correction bias is
  added only to *choose* experts; experts sit in `n_group` groups, a group scores the sum of its
  best two biased scores, and only the best `topk_group` groups are eligible; the weights are
  the chosen experts' unbiased scores, renormalised, times `routed_scaling_factor`.

`FusedMoE` keeps the experts stacked ([E, 2I, H] gate/up, [E, H, I] down). A step sorts its
(token, choice) pairs by expert, so each expert's tokens are one contiguous slice, and loops
over the experts that received tokens (at most E iterations, never one per token): two GEMMs
each, the weighted rows added back with one index_add_. Under tensor parallelism every rank
holds every expert's slice of the intermediate size (gate/up rows, down columns) and one
all-reduce sums the partial outputs, as for the dense MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import MoeConfig
from tandem.distributed.tensor_parallel import SINGLE_RANK, TensorParallel
from tandem.layers.linear import GateUpLinear, RowParallelLinear


class SharedExperts(nn.Module):
    """DeepSeek's shared experts: one SwiGLU MLP, `num_shared_experts` experts wide, that every
    token goes through beside its routed ones (checkpoint names shared_experts.*_proj)."""

    def __init__(self, hidden_size: int, intermediate: int, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(hidden_size, intermediate, False, tp)
        self.down_proj = RowParallelLinear(intermediate, hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


def route(logits: torch.Tensor, moe: MoeConfig, correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]) from router logits [T, E]."""
    logits = logits.float()
    if moe.scoring == "softmax":
        probs = torch.softmax(logits, dim=-1)
        weights, experts = torch.topk(probs, moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * moe.routed_scaling_factor, experts
    scores = logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if moe.n_group > 1:
        tokens, per_group = choice.shape[0], moe.num_experts // moe.n_group
        grouped = choice.view(tokens, moe.n_group, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(moe.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    experts = choice.topk(moe.top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, experts


class FusedMoE(nn.Module):
    def __init__(self, moe: MoeConfig, hidden_size: int, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__()
        self.moe = moe
        self.tp = tp
        self.intermediate = tp.divide(moe.intermediate_size, "expert intermediate size")
        experts = moe.num_experts
        self.gate = nn.Parameter(torch.empty(experts, hidden_size), requires_grad=False)  # the router
        self.w13 = nn.Parameter(torch.empty(experts, 2 * self.intermediate, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(experts, hidden_size, self.intermediate), requires_grad=False)
        self.correction_bias = (
            nn.Parameter(torch.zeros(experts), requires_grad=False) if moe.correction_bias else None
        )
        self.shared_experts = (
            SharedExperts(hidden_size, moe.num_shared_experts * moe.intermediate_size, tp)
            if moe.num_shared_experts else None
        )

    # --- loading: one expert's projection at a time (checkpoints store them separately) ----
    def load_expert(self, expert: int, projection: str, tensor: torch.Tensor) -> None:
        """`projection`: gate, up or down, as the checkpoint's whole [I, H] / [H, I] matrix."""
        inter = self.intermediate
        if projection == "down":
            self.w2.data[expert].copy_(self.tp.shard(tensor, 1))
            return
        rows = self.w13.data[expert].narrow(0, 0 if projection == "gate" else inter, inter)
        rows.copy_(self.tp.shard(tensor, 0))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`residual` + the experts' weighted outputs for x [T, H]."""
        weights, experts = route(F.linear(x, self.gate.to(x.dtype)), self.moe, self.correction_bias)
        out = self.experts_forward(x, weights, experts)
        out = self.tp.all_reduce(out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if residual is None else residual + out

    def experts_forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        top_k = experts.shape[1]
        flat_experts = experts.reshape(-1)
        order = flat_experts.argsort(stable=True)
        counts = torch.bincount(flat_experts, minlength=self.moe.num_experts).tolist()
        token_of = order // top_k  # row of x for each sorted (token, choice) pair
        rows = x.index_select(0, token_of)
        scale = weights.reshape(-1).index_select(0, order).unsqueeze(1)
        outputs = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            part = rows[start : start + count]
            gate, up = F.linear(part, self.w13[expert]).split(self.intermediate, dim=-1)
            outputs[start : start + count] = F.linear(F.silu(gate) * up, self.w2[expert])
            start += count
        out = torch.zeros_like(x)
        out.index_add_(0, token_of, (outputs.float() * scale).to(x.dtype))
        return out
