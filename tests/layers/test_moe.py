"""Mixture-of-experts routing and the fused expert layer.

DeepSeek-V3's group-limited routing is checked against transformers' own router on a config
where both the correction bias and the group limit change which experts are chosen (the
tiny configs transformers tests with pick all experts and exercise neither).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds

from tandem.config import MoeConfig
from tandem.layers.moe import FusedMoE, route

GROUPED = MoeConfig(num_experts=8, top_k=2, intermediate_size=16, norm_topk_prob=True, scoring="sigmoid",
                    n_group=4, topk_group=2, routed_scaling_factor=2.5, correction_bias=True)


def _hf_router(bias: torch.Tensor, weight: torch.Tensor) -> torch.nn.Module:
    config = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                           topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    router = hf_ds.DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(weight)
        router.e_score_correction_bias.copy_(bias)
    return router


def _sorted(weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = experts.argsort(dim=-1)
    return weights.gather(1, order), experts.gather(1, order)


def test_group_limited_routing_matches_transformers() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 32, generator=generator)
    bias = torch.randn(8, generator=generator) * 0.5
    hidden = torch.randn(64, 32, generator=generator)
    logits = F.linear(hidden, weight)
    with torch.no_grad():
        _, hf_weights, hf_experts = _hf_router(bias, weight)(hidden)
    weights, experts = route(logits, GROUPED, bias)
    hf_weights, hf_experts = _sorted(hf_weights, hf_experts)
    weights, experts = _sorted(weights, experts)
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights)

    # the test means something: the bias and the group limit each change some choices
    assert not torch.equal(_sorted(*route(logits, GROUPED))[1], experts)  # without the bias
    ungrouped = MoeConfig(**{**GROUPED.__dict__, "n_group": 1, "topk_group": 1})
    assert not torch.equal(_sorted(*route(logits, ungrouped, bias))[1], experts)
    # a chosen expert always lies in one of the token's two best groups
    choice = (logits.sigmoid() + bias).view(64, 4, 2)
    best_groups = choice.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    assert all(set((experts[t] // 2).tolist()) <= set(best_groups[t].tolist()) for t in range(64))


def _naive(moe: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: the definition the fused layer must equal."""
    weights, experts = route(F.linear(x, moe.gate), moe.moe, moe.correction_bias)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), experts[t].tolist(), strict=True):
            gate, up = (moe.w13[e] @ x[t]).split(moe.intermediate)
            out[t] += w * (moe.w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("config", [
    MoeConfig(num_experts=8, top_k=2, intermediate_size=16),
    MoeConfig(num_experts=6, top_k=3, intermediate_size=16, norm_topk_prob=False),
    GROUPED,
], ids=["softmax", "softmax-unnormalised-top3", "sigmoid-grouped"])
def test_fused_experts_equal_the_per_token_definition(config: MoeConfig) -> None:
    torch.manual_seed(0)
    moe = FusedMoE(config, hidden_size=24)
    for param in moe.parameters():
        param.data.normal_(0, 0.3)
    x = torch.randn(40, 24)
    residual = torch.randn(40, 24)
    torch.testing.assert_close(moe(x, residual), residual + _naive(moe, x), rtol=1e-5, atol=1e-5)
    # tokens really spread over the experts, and an empty batch is fine
    assert route(F.linear(x, moe.gate), config, moe.correction_bias)[1].unique().numel() > config.top_k
    assert moe(x[:0]).shape == (0, 24)


@pytest.mark.parametrize("fields, message", [
    ({"top_k": 9}, "num_experts_per_tok 9 must be between 1 and the 8 experts"),
    ({"n_group": 3}, "n_group 3 must divide the 8 experts"),
    ({"scoring": "relu"}, "unsupported expert scoring 'relu'"),
    ({"top_k": 6}, "exceeds the experts of 2 groups"),
])
def test_impossible_expert_configs_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MoeConfig(**{**GROUPED.__dict__, **fields})


def test_the_step_s_phases_are_profiler_ranges() -> None:
    moe = FusedMoE(GROUPED, hidden_size=24)
    for param in moe.parameters():
        param.data.normal_(0, 0.3)
    with torch.profiler.profile() as profiler:
        moe(torch.randn(8, 24))
    assert {"moe.route", "moe.experts"} <= {event.key for event in profiler.key_averages()}
