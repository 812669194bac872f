"""--kv-cache-dtype int8 on the Triton backend (its kernels interpreted on the CPU here): the
same rows, so the same number of blocks in a budget, and the same greedy tokens as the torch
backend over an int8 cache, prefix-cache hit included."""

from __future__ import annotations

import pytest

from tandem.llm import LLM
from tandem.types import SamplingParams

pytestmark = pytest.mark.slow


def _run(backend: str) -> tuple[int, list[list[int]]]:
    prompts = ["The capital of France is", "Write a haiku about the sea. " * 3]
    params = SamplingParams(max_tokens=4, temperature=0)
    llm = LLM("smollm2-135m", attention_backend=backend, kv_cache_memory="32MiB", max_model_len=64,
              kv_cache_dtype="int8", block_size=16)  # the Triton kernels' GPU default block
    try:
        first = llm.generate(prompts, params)
        second = llm.generate([prompts[1] + " And again"], params)
        assert second[0].num_cached_tokens > 0  # a chunk after a cached prefix of int8 rows
        return llm.engine.core.num_blocks, [o.outputs[0].token_ids for o in first + second]
    finally:
        llm.shutdown()


def test_the_triton_kernels_read_an_int8_cache_as_the_torch_backend_does() -> None:
    blocks, tokens = _run("triton")
    assert (blocks, tokens) == _run("torch")
