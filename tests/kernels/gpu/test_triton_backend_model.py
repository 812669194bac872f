"""The whole default model with `--attention-backend triton` (the kernels interpreted on the
CPU): greedy tokens identical to the torch backend's, which the engine tests hold equal to
transformers'. A batch of two prompts (prefills, then decodes side by side), then a prompt
that extends one of them, so a chunk runs after a cached prefix that ends mid-block."""

from __future__ import annotations

import pytest

from tandem.llm import LLM
from tandem.types import SamplingParams

pytestmark = pytest.mark.slow


def _tokens(backend: str) -> list[list[int]]:
    prompts = ["The capital of France is", "Write a haiku about the sea. " * 3]
    params = SamplingParams(max_tokens=4, temperature=0)
    llm = LLM("smollm2-135m", attention_backend=backend, kv_cache_memory="64MiB", block_size=16)  # a GPU's default
    try:
        first = llm.generate(prompts, params)
        second = llm.generate([prompts[1] + " And again"], params)
        assert second[0].num_cached_tokens > 0
        return [o.outputs[0].token_ids for o in first + second]
    finally:
        llm.shutdown()


def test_greedy_tokens_equal_the_torch_backend() -> None:
    assert _tokens("triton") == _tokens("torch")
