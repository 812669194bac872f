"""--kv-cache-dtype bfloat16 under an fp32 model: half the fp32 cache's bytes a token, so twice
its blocks in a budget; the rows read by the C decode kernel (bf16 rows for fp32 queries) and
the module path's prefill; the easy prompt's greedy answer kept, a prefix-cache hit too."""

from __future__ import annotations

import pytest
import torch

from tandem.llm import LLM
from tandem.types import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = ("You are a helpful assistant who answers questions about geography in short, plain sentences.\n"
          "Question: which city is the capital of France?\nAnswer: The capital of France is")


def _run(kv_cache_dtype: str, attention_backend: str = "auto") -> tuple[int, torch.dtype, str, str, int]:
    params = SamplingParams(max_tokens=8, temperature=0)
    llm = LLM("smollm2-135m", exact=True, kv_cache_memory="32MiB", max_model_len=256, kv_cache_dtype=kv_cache_dtype,
              attention_backend=attention_backend, block_size=16)  # the short prompt still fills a block
    try:
        runner = llm.engine.core.executor.worker.runner
        first = llm.generate([PROMPT], params)[0]
        again = llm.generate([PROMPT], params)[0]  # its prompt's full blocks from the prefix cache
        return (llm.engine.core.num_blocks, runner.kv_cache.dtype, first.outputs[0].text, again.outputs[0].text,
                again.num_cached_tokens)
    finally:
        llm.shutdown()


def test_a_bf16_cache_under_an_fp32_model_holds_twice_the_blocks_and_gives_the_same_answer() -> None:
    fp32_blocks, fp32_dtype, fp32_text, _, _ = _run("auto")
    blocks, dtype, text, again, cached = _run("bfloat16")
    assert (fp32_dtype, dtype) == (torch.float32, torch.bfloat16)
    assert 2 * fp32_blocks <= blocks <= 2 * fp32_blocks + 1  # each budget over its block size, rounded down
    assert text == fp32_text and "Paris" in text
    assert again == text and cached > 0


def test_the_triton_kernels_read_a_bf16_cache_under_an_fp32_model() -> None:
    """The Triton backend (interpreted here) writes fp32 keys and values into bf16 rows and reads
    them for fp32 queries: the same easy answer as the CPU backends', a prefix-cache hit too."""
    blocks, dtype, text, again, cached = _run("bfloat16", "triton")
    assert dtype == torch.bfloat16
    assert "Paris" in text and again == text and cached > 0
