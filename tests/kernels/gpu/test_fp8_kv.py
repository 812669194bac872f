"""--kv-cache-dtype fp8 through the engine: a quarter of an fp32 cache's bytes per block, so
four times the blocks in the same budget, and the default model still answers the easy
prompt as the exact engine does (here the Triton kernels run interpreted on the CPU)."""

from __future__ import annotations

import pytest
import torch

from tandem.batch.prepared import ScheduledChunk, prepare_batch
from tandem.kernels.base import kv_cache_shape
from tandem.kernels.gpu.backend import TritonAttentionBackend
from tandem.layers.attention import PagedAttention
from tandem.llm import LLM
from tandem.types import SamplingParams
from tandem.worker.kv_scales import power_of_two_scale

pytestmark = pytest.mark.slow


def _run(kv_cache_dtype: str, backend: str) -> tuple[int, list[int]]:
    llm = LLM("smollm2-135m", attention_backend=backend, kv_cache_memory="32MiB", max_model_len=64,
              kv_cache_dtype=kv_cache_dtype)
    try:
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0))
        return llm.engine.core.num_blocks, out[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_fp8_cache_holds_four_times_the_fp32_blocks_and_answers_alike() -> None:
    blocks, exact = _run("auto", "torch")
    fp8_blocks, tokens = _run("fp8", "triton")
    assert 4 * blocks <= fp8_blocks < 4 * (blocks + 1)  # the same budget, each floored
    assert tokens == exact


def _attend_steps(layer, cache: torch.Tensor, magnitude: float) -> list[torch.Tensor]:  # noqa: ANN001
    """A 40-token prefill in two chunks, then a decode step, through `layer`: each output."""
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(41, 4, 16, generator=generator)
    k = torch.randn(41, 2, 16, generator=generator) * magnitude
    v = torch.randn(41, 2, 16, generator=generator) * magnitude
    outputs = []
    for start, count in ((0, 24), (24, 16), (40, 1)):
        chunk = ScheduledChunk("r", list(range(start, start + count)), start, [2, 0, 3], True)
        meta = prepare_batch([chunk], 16).meta
        rows = slice(start, start + count)
        outputs.append(layer(q[rows], k[rows], v[rows], cache, meta))
    return outputs


def test_a_layer_beyond_e4m3s_range_keeps_its_values_with_a_measured_scale() -> None:
    """Keys and values a thousand strong: an fp8 cache at scale 1.0 clamps them at 448 (the
    output comes back about half as large as it should); with the scales the worker measures
    (a power of two over 4x the largest, worker/kv_scales.py) they keep e4m3's three mantissa
    bits, and the output is within a few percent of the float cache's."""
    backend = TritonAttentionBackend()
    exact = _attend_steps(PagedAttention(4, 2, 16, backend), torch.zeros(kv_cache_shape(4, 16, 2, 16)), 1000.0)
    largest = 1000.0 * 4.5  # above any of the 41 x 2 x 16 normal draws times 1000
    plain = PagedAttention(4, 2, 16, backend)
    scaled = PagedAttention(4, 2, 16, backend)
    scaled.k_scale = scaled.v_scale = power_of_two_scale(largest)
    assert scaled.k_scale == 64.0
    fp8 = torch.float8_e4m3fn
    clamped = _attend_steps(plain, torch.zeros(kv_cache_shape(4, 16, 2, 16), dtype=fp8), 1000.0)
    kept = _attend_steps(scaled, torch.zeros(kv_cache_shape(4, 16, 2, 16), dtype=fp8), 1000.0)
    for want, bad, good in zip(exact, clamped, kept, strict=True):
        scale = want.abs().mean()
        assert (good - want).abs().mean() < 0.1 * scale
        assert (bad - want).abs().mean() > 0.3 * scale


def test_the_engine_measures_each_layers_scales_at_start() -> None:
    """--kv-cache-dtype fp8: before it serves, the worker runs the built-in text through the
    model (its first 64 tokens here: the context) and gives every attention layer a
    power-of-two scale for its keys and values."""
    import math

    from tandem.worker.kv_scales import attention_layers

    llm = LLM("smollm2-135m", attention_backend="triton", kv_cache_memory="32MiB", max_model_len=64,
              kv_cache_dtype="fp8")
    try:
        layers = attention_layers(llm.engine.runner.model)
        scales = [(layer.k_scale, layer.v_scale) for layer in layers]
        assert len(scales) == 30 and all(layer.observed is None for layer in layers)
        assert all(math.log2(s).is_integer() for pair in scales for s in pair)
        assert any(pair != (1.0, 1.0) for pair in scales)  # measured, not left at 1.0
        assert not llm.engine.runner.kv_cache.float().abs().sum()  # the calibration's blocks zeroed
    finally:
        llm.shutdown()


def test_the_triton_write_divides_and_rounds_as_the_layer_and_torch_do() -> None:
    """With scales the Triton backend takes the layer's multipliers into its write kernel
    (`scaled_kv_write`) instead of the layer dividing first: the cache holds the very bytes
    the torch backend stores after the layer's division, and the outputs agree."""
    from tandem.kernels.torch_attention import TorchAttentionBackend

    caches, outputs = {}, {}
    for name, backend in (("triton", TritonAttentionBackend()), ("torch", TorchAttentionBackend())):
        layer = PagedAttention(4, 2, 16, backend)
        layer.k_scale, layer.v_scale = 64.0, 0.25
        caches[name] = torch.zeros(kv_cache_shape(4, 16, 2, 16), dtype=torch.float8_e4m3fn)
        outputs[name] = _attend_steps(layer, caches[name], 100.0)
    assert TritonAttentionBackend.capabilities.scaled_kv_write
    assert torch.equal(caches["triton"].view(torch.uint8), caches["torch"].view(torch.uint8))
    assert caches["torch"].view(torch.uint8).count_nonzero() > 1000
    # Each output is a weighted sum of values ~100 strong, summed in another order by each
    # backend (the Triton kernel's online softmax): an entry near zero is a difference of
    # large terms, so its error is measured against the outputs' scale, not its own (an
    # AVX-512 Zen 5 left 4e-4 on an entry of 0.36 among entries up to 112: ~50 fp32 ulps).
    for got, want in zip(outputs["triton"], outputs["torch"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-4)
