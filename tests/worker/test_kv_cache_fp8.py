"""--kv-cache-dtype fp8 through the engine on the default model, on the CPU backends: a byte
a value, so the budget holds twice a bf16 cache's blocks (four times an fp32 one's); the
worker measures each layer's scales at start; perplexity near the model's own cache's over
1,024 tokens; a share of greedy continuations token for token the model's-dtype cache's; a
prefix-cache hit reads back what a miss computed.

fp8 is over the issue's 8-bit bar (0.5%) as a cache: `tandem bench perplexity --kv-dtypes fp8
--kv-cache-dtypes fp8,int8` over the 3,723-token text gave +1.64% on this model and +2.49% on
Qwen2.5-Coder-0.5B (int8: +0.04%, +0.32%), and the start-up log says so (worker/kv_scales.py
FP8_QUALITY). Over the first 1,024 tokens it was -0.26% (the torch backend +0.18%), so the
bound below guards against an fp8 cache read wrongly (a scale lost: tens of percent), not the
bar. Measured on the 2-core AMD EPYC with AVX-512 (exact fp32 model, 2026-12-04): 4 of 8
continuations of 32 tokens identical (int8: 7), the other four departing where the exact
model's two best tokens were 0.04, 0.10, 0.56 and 1.26 nats apart (three mantissa bits move
logits past wide margins too, so this test does not say a departure is a near-tie); every
hit's continuation the miss's.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.kv_cache_quality import CacheRun, measure_cache

pytestmark = pytest.mark.slow

PERPLEXITY_BOUND = 0.01  # over 1,024 tokens (measured -0.26%); not the 0.5% bar, which fp8 misses on longer text
FLOOR_IDENTICAL = 3  # of 8 continuations, the model's-dtype cache's (4 measured)
FLOOR_HIT_IDENTICAL = 6  # of 8, the prefix-cache hit's continuation the miss's (8 measured)
FIRST_STEP = 0.02  # nats a hit's first-step logprobs may differ from its miss's (8e-4 measured)


@pytest.fixture(scope="module")
def exact() -> CacheRun:
    return measure_cache("auto")


@pytest.fixture(scope="module")
def fp8() -> CacheRun:
    return measure_cache("fp8")


def test_a_value_takes_a_byte(exact, fp8) -> None:
    ratio = exact.block_bytes // fp8.block_bytes
    assert exact.block_bytes == ratio * fp8.block_bytes and ratio in (2, 4)  # a bf16 or an fp32 model
    assert fp8.num_blocks == (64 << 20) // fp8.block_bytes
    assert fp8.num_blocks >= ratio * exact.num_blocks


def test_perplexity_near_the_model_s_own_cache_and_a_share_of_greedy_answers_kept(exact, fp8) -> None:
    assert fp8.perplexity == pytest.approx(exact.perplexity, rel=PERPLEXITY_BOUND)
    assert fp8.perplexity != exact.perplexity  # the fp8 values were read, not the model's dtype
    kept = sum(ours == reference for ours, reference in zip(fp8.first, exact.first, strict=True))
    assert kept >= FLOOR_IDENTICAL


def test_a_prefix_cache_hit_reads_back_what_the_miss_computed(fp8) -> None:
    """A first prefill attends to the fp8 values the cache holds (not the exact ones it wrote),
    as the hit does, so the hit's first step gives the miss's distribution: a scale lost or
    another block read would move it by far more than FIRST_STEP. Continuations may still
    part later, and not only at near-ties: the hit computes its uncached prompt tokens in a
    step of another size, whose fp32 sums differ in the last places, and where a value lies
    at an fp8 rounding boundary its three mantissa bits flip by an eighth. On the 2-core AMX
    Xeon (2026-12-05) one of 8 continuations parted at token 19 where the miss's two best
    tokens were 0.52 nats apart, its first step 8e-4 nats from the miss's."""
    for again, first in zip(fp8.again_steps, fp8.first_steps, strict=True):
        common = again.keys() & first.keys()
        assert len(common) >= 2 and all(abs(again[token] - first[token]) < FIRST_STEP for token in common), (again,
                                                                                                             first)
    assert sum(again == first for again, first in zip(fp8.again, fp8.first, strict=True)) >= FLOOR_HIT_IDENTICAL


def test_the_worker_measured_each_layer_s_scales() -> None:
    from tandem.llm import LLM

    with LLM(kv_cache_memory="16MiB", kv_cache_dtype="fp8") as llm:
        layers = llm.engine.runner.model.model.layers
        assert llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
        scales = [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in layers]
    assert len(set(scales)) > 1 and all(k < 1 and v < 1 for k, v in scales)  # SmolLM2's are all below 1


def test_the_start_up_log_says_fp8_is_over_the_quality_bar(caplog: pytest.LogCaptureFixture) -> None:
    from tandem.llm import LLM
    from tandem.worker.kv_scales import FP8_QUALITY

    with caplog.at_level("WARNING"), LLM(kv_cache_memory="16MiB", kv_cache_dtype="fp8"):
        pass
    assert FP8_QUALITY in caplog.text and "over the 8-bit quality bar" in FP8_QUALITY
