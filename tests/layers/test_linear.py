"""Merged projections and the bf16 small-step weight copies."""

from __future__ import annotations

import torch

from tandem.layers.linear import Linear, LowPrecisionPolicy, MergedLinear, attach_low_precision


def test_merged_linear_loads_shards_into_row_ranges() -> None:
    layer = MergedLinear(4, [3, 2, 2])
    parts = [torch.randn(3, 4), torch.randn(2, 4), torch.randn(2, 4)]
    for index, part in enumerate(parts):
        layer.load("weight", part, shard=index)
    x = torch.randn(5, 4)
    torch.testing.assert_close(layer(x), x @ torch.cat(parts).T)


def test_low_precision_copy_used_only_for_small_steps() -> None:
    torch.manual_seed(0)
    layer = Linear(64, 32, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    exact = Linear(64, 32, bias=True)
    exact.load_state_dict(layer.state_dict())
    added = attach_low_precision(layer, LowPrecisionPolicy(max_tokens=4))
    assert added == 64 * 32 * 2

    small, large = torch.randn(4, 64), torch.randn(5, 64)
    # a step above the threshold is bit-identical to fp32
    assert torch.equal(layer(large), exact(large))
    # a small step reads the bf16 copy: close to fp32, but not identical, and still fp32 out
    out = layer(small)
    assert out.dtype == torch.float32
    assert not torch.equal(out, exact(small))
    torch.testing.assert_close(out, exact(small), rtol=0.05, atol=0.3)
