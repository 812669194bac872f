"""Merged projections and the bf16 small-step weight copies."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.linear import Linear, MergedLinear, SmallStepWeights, attach_small_step_weights


def test_merged_linear_loads_shards_into_row_ranges() -> None:
    layer = MergedLinear(4, [3, 2, 2])
    parts = [torch.randn(3, 4), torch.randn(2, 4), torch.randn(2, 4)]
    for index, part in enumerate(parts):
        layer.load("weight", part, shard=index)
    x = torch.randn(5, 4)
    torch.testing.assert_close(layer(x), x @ torch.cat(parts).T)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 0.02), (torch.bfloat16, 0.05)])
def test_small_step_copy_used_only_for_small_steps(dtype: torch.dtype, tolerance: float) -> None:
    torch.manual_seed(0)
    layer = Linear(64, 32, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    exact = Linear(64, 32, bias=True)
    exact.load_state_dict(layer.state_dict())
    added = attach_small_step_weights(layer, SmallStepWeights(max_tokens=4, dtype=dtype))
    assert added == 64 * 32 * torch.empty((), dtype=dtype).element_size()

    small, large = torch.randn(4, 64), torch.randn(5, 64)
    # a step above the threshold is bit-identical to fp32
    assert torch.equal(layer(large), exact(large))
    # a small step reads the copy: close to fp32 (bit-different for half precision), fp32 out
    out = layer(small)
    assert out.dtype == torch.float32
    if dtype != torch.float32:
        assert not torch.equal(out, exact(small))
    torch.testing.assert_close(out, exact(small), rtol=tolerance, atol=tolerance * 8)
    layer.small_weight.zero_()  # proves which copy a step reads
    assert torch.equal(layer(small), torch.zeros_like(out) + layer.small_bias.float())
    assert torch.equal(layer(large), exact(large))
