"""PagedAttention's per-layer KV scales: a cache that holds key / k_scale and value / v_scale
gives the attention of the unscaled keys and values (exactly, for powers of two in a float
cache), because the layer folds the scales into the softmax scale and the output."""

from __future__ import annotations

import pytest
import torch

from tandem.batch.prepared import ScheduledChunk, prepare_batch
from tandem.kernels.base import kv_cache_shape
from tandem.kernels.torch_attention import TorchAttentionBackend
from tandem.layers.attention import PagedAttention

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4


def _prefill_then_decode(layer: PagedAttention, cache: torch.Tensor, seed: int, magnitude: float = 1.0,
                         ) -> list[torch.Tensor]:
    """A 10-token prefill in two chunks, then one decode step: each step's output."""
    generator = torch.Generator().manual_seed(seed)
    tokens = 11
    q = torch.randn(tokens, HEADS, DIM, generator=generator)
    k = torch.randn(tokens, KV_HEADS, DIM, generator=generator) * magnitude
    v = torch.randn(tokens, KV_HEADS, DIM, generator=generator) * magnitude
    blocks = [3, 0, 5]
    outputs = []
    for start, count in ((0, 6), (6, 4), (10, 1)):
        chunk = ScheduledChunk("r", list(range(start, start + count)), start, blocks, True)
        meta = prepare_batch([chunk], BLOCK).meta
        rows = slice(start, start + count)
        outputs.append(layer(q[rows], k[rows], v[rows], cache, meta))
    return outputs


@pytest.mark.parametrize("scales", [(0.25, 8.0), (2.0**-6, 2.0**-3), (16.0, 1.0)])
def test_power_of_two_scales_in_a_float_cache_change_nothing(scales: tuple[float, float]) -> None:
    backend = TorchAttentionBackend()
    plain = PagedAttention(HEADS, KV_HEADS, DIM, backend)
    scaled = PagedAttention(HEADS, KV_HEADS, DIM, backend)
    scaled.k_scale, scaled.v_scale = scales
    plain_cache = torch.zeros(kv_cache_shape(8, BLOCK, KV_HEADS, DIM))
    scaled_cache = torch.zeros(kv_cache_shape(8, BLOCK, KV_HEADS, DIM))
    want = _prefill_then_decode(plain, plain_cache, seed=1)
    got = _prefill_then_decode(scaled, scaled_cache, seed=1)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    # the cache holds the divided keys and values
    assert torch.equal(scaled_cache[0] * scales[0], plain_cache[0])
    assert torch.equal(scaled_cache[1] * scales[1], plain_cache[1])
    assert not torch.equal(scaled_cache, plain_cache)


def test_a_calibrating_layer_notes_its_largest_key_and_value() -> None:
    layer = PagedAttention(HEADS, KV_HEADS, DIM, TorchAttentionBackend())
    layer.observed = []
    cache = torch.zeros(kv_cache_shape(8, BLOCK, KV_HEADS, DIM))
    _prefill_then_decode(layer, cache, seed=2, magnitude=3.0)
    assert len(layer.observed) == 3
    keys = cache[0, :, [3, 0, 5]].abs().amax()  # everything the three steps wrote
    assert max(k for k, _ in layer.observed) == pytest.approx(float(keys))
    assert all(k > 0 and v > 0 for k, v in layer.observed)
