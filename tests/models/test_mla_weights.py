"""The rotary-row reorder of latent attention weights, on a rank's heads, in place."""

from __future__ import annotations

import torch

from tandem.config import MLAConfig
from tandem.models.mla_weights import deinterleave_rope_rows, deinterleave_rope_rows_

MLA = MLAConfig(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=4, qk_rope_head_dim=6, v_head_dim=5)


def test_a_rank_reorders_its_own_heads_as_the_whole_would_be() -> None:
    heads = 4
    query = torch.randn(heads * MLA.qk_head_dim, 16)
    whole = deinterleave_rope_rows("model.layers.0.self_attn.q_b_proj.weight", query, MLA, heads)
    per_head = query.view(heads, MLA.qk_head_dim, 16)
    rot = per_head[:, MLA.qk_nope_head_dim :]
    assert torch.equal(whole.view(heads, MLA.qk_head_dim, 16)[:, MLA.qk_nope_head_dim :],
                       torch.cat((rot[:, 0::2], rot[:, 1::2]), dim=1))  # evens, then odds
    for rank in range(2):  # 2 heads each, as a rank of two holds them after its copy
        rows = query.narrow(0, rank * 2 * MLA.qk_head_dim, 2 * MLA.qk_head_dim).clone()
        assert deinterleave_rope_rows_("model.layers.0.self_attn.q_b_proj.weight", rows, MLA) is rows
        assert torch.equal(rows, whole.narrow(0, rank * 2 * MLA.qk_head_dim, 2 * MLA.qk_head_dim))


def test_the_latent_projection_keeps_its_latent_rows() -> None:
    for name, tensor in [("kv_a_proj_with_mqa.weight", torch.randn(MLA.latent_dim, 16)),
                         ("kv_a_proj_with_mqa.bias", torch.randn(MLA.latent_dim))]:
        fixed = deinterleave_rope_rows_(name, tensor.clone(), MLA)
        assert torch.equal(fixed[: MLA.kv_lora_rank], tensor[: MLA.kv_lora_rank])
        rot = tensor[MLA.kv_lora_rank :]
        assert torch.equal(fixed[MLA.kv_lora_rank :], torch.cat((rot[0::2], rot[1::2])))


def test_other_weights_and_plain_rope_are_left_alone() -> None:
    tensor = torch.randn(MLA.latent_dim, 16)
    assert deinterleave_rope_rows_("kv_b_proj.weight", tensor, MLA) is tensor
    plain = MLAConfig(16, 12, 4, 6, 5, rope_interleave=False)
    assert torch.equal(deinterleave_rope_rows_("kv_a_proj_with_mqa.weight", tensor.clone(), plain), tensor)
