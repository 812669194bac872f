"""--kv-cache-dtype fp8 through the engine: a quarter of an fp32 cache's bytes per block, so
four times the blocks in the same budget, and the default model still answers the easy
prompt as the exact engine does (here the Triton kernels run interpreted on the CPU)."""

from __future__ import annotations

import pytest

from tandem.llm import LLM
from tandem.types import SamplingParams

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


def test_fp8_needs_the_triton_backend() -> None:
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 needs the Triton attention backend"):
        LLM("smollm2-135m", attention_backend="cpu", kv_cache_memory="32MiB", kv_cache_dtype="fp8")
