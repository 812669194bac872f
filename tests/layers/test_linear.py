"""Merged projections, oneDNN-packed weights and the half-precision small-step copies."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.linear import (
    Linear,
    MergedLinear,
    SmallStepWeights,
    attach_small_step_weights,
    onednn_available,
    pack_weights_for_cpu,
)


def _random_pair(bias: bool = True) -> tuple[Linear, Linear]:
    torch.manual_seed(0)
    layer = Linear(64, 32, bias=bias)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    exact = Linear(64, 32, bias=bias)
    exact.load_state_dict(layer.state_dict())
    return layer, exact


def test_merged_linear_loads_shards_into_row_ranges() -> None:
    layer = MergedLinear(4, [3, 2, 2])
    parts = [torch.randn(3, 4), torch.randn(2, 4), torch.randn(2, 4)]
    for index, part in enumerate(parts):
        layer.load("weight", part, shard=index)
    x = torch.randn(5, 4)
    torch.testing.assert_close(layer(x), x @ torch.cat(parts).T)


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("bias", [True, False])
def test_packed_weights_compute_the_same_linear(bias: bool) -> None:
    layer, exact = _random_pair(bias)
    assert pack_weights_for_cpu(layer) == 1
    assert layer.packed_weight is not None and layer.weight.numel() == 0  # dense copy released
    for tokens in (1, 3, 64, 300):
        x = torch.randn(tokens, 64)
        torch.testing.assert_close(layer(x), exact(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 0.02), (torch.bfloat16, 0.05)])
def test_small_step_copy_used_only_for_small_steps(dtype: torch.dtype, tolerance: float) -> None:
    layer, exact = _random_pair()
    added = attach_small_step_weights(layer, SmallStepWeights(max_tokens=4, dtype=dtype))
    assert added == 64 * 32 * 2

    small, large = torch.randn(4, 64), torch.randn(5, 64)
    assert torch.equal(layer(large), exact(large))  # above the threshold: the fp32 weights
    out = layer(small)
    assert out.dtype == torch.float32
    assert not torch.equal(out, exact(small))
    torch.testing.assert_close(out, exact(small), rtol=tolerance, atol=tolerance * 8)
    layer.small_weight.zero_()  # proves which copy a small step reads
    assert torch.equal(layer(small), torch.zeros_like(out) + layer.small_bias.float())
