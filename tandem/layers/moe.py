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

Under expert parallelism (distributed/expert_parallel.py) a rank holds whole experts, its
contiguous share of them, and the router and shared experts whole. Each rank routes its own
slice of the step's tokens, sends every (token, choice) row to the rank of its expert
(all-to-all), runs its experts on the rows it received (the same sort-by-expert loop), sends
the outputs back (the reverse all-to-all), weights and sums them, adds the shared experts,
and the slices are gathered so that every rank returns every token's output.

The step's phases are profiler ranges: moe.route, moe.dispatch, moe.experts, moe.combine,
moe.gather (entered only while a profiler runs: otherwise they cost a flag check).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import MoeConfig
from tandem.distributed.expert_parallel import ExpertParallel
from tandem.distributed.tensor_parallel import SINGLE_RANK, TensorParallel
from tandem.kernels.dense_gemv import DenseGemvKernel
from tandem.layers.int4_experts import Int4Experts
from tandem.layers.linear import GEMV_MAX_ROWS, GateUpLinear, RowParallelLinear, dense_linear
from tandem.platform.profiling import profiled


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
    """The MoE MLP of one layer: the router, the stacked routed experts, the shared experts.

    `tp`: every expert split by its intermediate size (one all-reduce after the combine).
    `ep` (size > 1): the experts split by expert instead, `tp` unused: this rank holds experts
    `local_expert_range` whole ([E_local, ...] stacks) and the router and shared experts whole.
    `int4_experts`: the routed experts stay in the checkpoint's INT4 levels (`Int4Experts`,
    no w13/w2 in the run dtype); routing, shared experts and the combine are the same.
    """

    def __init__(
        self, moe: MoeConfig, hidden_size: int, tp: TensorParallel = SINGLE_RANK, ep: ExpertParallel | None = None,
        int4_experts: bool = False,
    ) -> None:
        super().__init__()
        self.moe = moe
        self.ep = ep if ep is not None and ep.split else None
        if self.ep is not None:
            tp = SINGLE_RANK  # whole experts on each rank, each token's output on one rank only
            first, experts = self.ep.local_experts(moe.num_experts)
        else:
            first, experts = 0, moe.num_experts
        self.tp = tp
        self.local_expert_range = range(first, first + experts)
        self.intermediate = tp.divide(moe.intermediate_size, "expert intermediate size")
        self.gate = nn.Parameter(torch.empty(moe.num_experts, hidden_size), requires_grad=False)  # the router
        self.int4 = Int4Experts(experts, hidden_size, self.intermediate, tp) if int4_experts else None
        self.gemv: DenseGemvKernel | None = None  # bf16 experts on a CPU without a bf16 GEMM (attach_bf16_gemv)
        if self.int4 is None:
            self.w13 = nn.Parameter(torch.empty(experts, 2 * self.intermediate, hidden_size), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(experts, hidden_size, self.intermediate), requires_grad=False)
        self.correction_bias = (
            nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False) if moe.correction_bias else None
        )
        self.shared_experts = (
            SharedExperts(hidden_size, moe.num_shared_experts * moe.intermediate_size, tp)
            if moe.num_shared_experts else None
        )

    # --- loading: one expert's projection at a time (checkpoints store them separately) ----
    def owns_expert(self, expert: int) -> bool:
        """Whether this rank holds (global) expert `expert`: always, unless expert-parallel.

        The model's expected_weight_names lists every expert of the checkpoint; under expert
        parallelism a loader should count the others' weights as accounted for (they are
        another rank's) and, where it can, skip reading them at all by asking this first."""
        return expert in self.local_expert_range

    def load_expert(self, expert: int, projection: str, tensor: torch.Tensor, field: str = "weight") -> None:
        """`projection`: gate, up or down, as the checkpoint's whole [I, H] / [H, I] matrix of
        global expert `expert` (`field` "weight"), or one of its INT4 tensors (weight_packed,
        weight_scale, weight_shape). Another rank's expert is ignored, `tensor` left untouched
        (a lazily mapped checkpoint tensor is then never read)."""
        if (field == "weight") != (self.int4 is None):
            raise ValueError(f"expert {expert} {projection}_proj.{field}: the checkpoint's experts are "
                             f"{'dense' if field == 'weight' else 'INT4'}, this model was built for "
                             f"{'INT4' if self.int4 is not None else 'dense'} ones (quantization_config)")
        if not self.owns_expert(expert):
            return
        expert -= self.local_expert_range.start
        if self.int4 is not None:
            self.int4.load(expert, projection, field, tensor)
            return
        inter = self.intermediate
        if projection == "down":
            self.w2.data[expert].copy_(self.tp.shard(tensor, 1))
            return
        rows = self.w13.data[expert].narrow(0, 0 if projection == "gate" else inter, inter)
        rows.copy_(self.tp.shard(tensor, 0))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`residual` + the experts' weighted outputs for x [T, H]."""
        if self.ep is not None:
            out = self._expert_parallel_forward(x)
            return out if residual is None else residual + out
        with profiled("moe.route"):
            weights, experts = route(F.linear(x, self.gate.to(x.dtype)), self.moe, self.correction_bias)
        out = self.experts_forward(x, weights, experts)
        out = self.tp.all_reduce(out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if residual is None else residual + out

    def experts_forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        with profiled("moe.experts"):
            top_k = experts.shape[1]
            flat_experts = experts.reshape(-1)
            order = flat_experts.argsort(stable=True)
            counts = torch.bincount(flat_experts, minlength=self.moe.num_experts).tolist()
            token_of = order // top_k  # row of x for each sorted (token, choice) pair
            rows = x.index_select(0, token_of)
            scale = weights.reshape(-1).index_select(0, order).unsqueeze(1)
            outputs = self._run_experts(rows, counts)
            out = torch.zeros_like(x)
            out.index_add_(0, token_of, (outputs.float() * scale).to(x.dtype))
            return out

    def _run_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each local expert's SwiGLU on its slice of `rows`, sorted by expert, `counts[e]` rows
        for local expert e: one pass per expert that received any, never one per token."""
        if self.int4 is not None:
            return self.int4(rows, counts)
        outputs = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            part = rows[start : start + count]
            gate, up = self._expert_linear(part, self.w13[expert]).split(self.intermediate, dim=-1)
            outputs[start : start + count] = self._expert_linear(F.silu(gate) * up, self.w2[expert])
            start += count
        return outputs

    def _expert_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One expert's projection: the bf16 GEMV kernel for a few rows where it is given (a
        CPU without a bf16 GEMM), else `dense_linear`."""
        if self.gemv is not None and x.shape[0] <= GEMV_MAX_ROWS and weight.dtype == torch.bfloat16:
            return self.gemv.gemv(weight, x.float().contiguous()).to(x.dtype)
        return dense_linear(x, weight)

    def _expert_parallel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' and shared experts' outputs for every row of x [T, H] (the same x on
        every rank of the group), each rank routing and combining its own slice of the tokens."""
        ep = self.ep
        per_rank = len(self.local_expert_range)
        token_counts = [ep.token_slice(x.shape[0], rank)[1] for rank in range(ep.size)]
        start, count = ep.token_slice(x.shape[0])
        mine = x[start : start + count]

        with profiled("moe.route"):
            weights, experts = route(F.linear(mine, self.gate.to(x.dtype)), self.moe, self.correction_bias)
        with profiled("moe.dispatch"):
            top_k = experts.shape[1]
            flat_experts = experts.reshape(-1)
            order = flat_experts.argsort(stable=True)  # by expert, hence by the rank that owns it
            token_of = order // top_k
            # [rank, its local expert]: how many rows this rank sends each expert of the group
            sent = torch.bincount(flat_experts, minlength=self.moe.num_experts).view(ep.size, per_rank)
            received = ep.exchange_counts(sent)  # [source rank, local expert]
            send_counts, recv_counts = sent.sum(1).tolist(), received.sum(1).tolist()
            rows = ep.all_to_all(mine.index_select(0, token_of), send_counts, recv_counts)
        with profiled("moe.experts"):
            # rows arrive by source rank, each source's sorted by expert: sort them by expert
            local_expert = torch.arange(per_rank, device=x.device).repeat(ep.size).repeat_interleave(received.reshape(-1))
            by_expert = local_expert.argsort(stable=True)
            sorted_outputs = self._run_experts(rows.index_select(0, by_expert), received.sum(0).tolist())
            outputs = torch.empty_like(sorted_outputs).index_copy_(0, by_expert, sorted_outputs)
        with profiled("moe.combine"):
            returned = ep.all_to_all(outputs, recv_counts, send_counts)  # in `order`, as sent
            scale = weights.reshape(-1).index_select(0, order).unsqueeze(1)
            out = torch.zeros(mine.shape, dtype=torch.float32, device=x.device)
            out.index_add_(0, token_of, returned.float() * scale)
            out = out.to(x.dtype)
            if self.shared_experts is not None:
                out = out + self.shared_experts(mine)
        with profiled("moe.gather"):
            return ep.all_gather_rows(out, token_counts)


def attach_expert_gemv(model: nn.Module, kernel: DenseGemvKernel) -> int:
    """Give every layer of dense bf16 experts the GEMV kernel for experts that receive a few
    rows (a CPU without a bf16 GEMM); returns the layers given it."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE) and m.int4 is None and m.w13.dtype == torch.bfloat16]
    for layer in layers:
        layer.gemv = kernel
    return len(layers)
