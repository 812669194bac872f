"""Decode steps through `StaticDecodeStep`'s static buffers and padding, the part of the CUDA
graph path that is the same on every device: here the Triton kernels run interpreted on the
CPU and each "replay" is the forward run eagerly on the padded buffers (`graphs=False`).

Greedy tokens must equal the plain (torch backend) path's, with batch sizes that need padding (3 rows run as
the size-4 set, 6 as 8), a cached prefix, and requests finishing at different steps so
the batch shrinks between steps; padded rows must not write the cache (their slot is -1).
"""

from __future__ import annotations

import pytest

from tandem.llm import LLM
from tandem.types import SamplingParams
from tandem.worker.cuda_graphs import capture_sizes

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Write a haiku about the sea. " * 3, "1, 2, 3,", "def add(a, b):",
           "Once upon a time", "The quick brown fox"]


def _run(static: bool) -> tuple[list[list[int]], int]:
    # The plain path runs on the torch backend: test_triton_backend_model holds the Triton
    # kernels' tokens equal to it, and it is ~100x faster than the interpreter.
    llm = LLM("smollm2-135m", attention_backend="triton" if static else "torch", kv_cache_memory="64MiB", max_model_len=128)
    try:
        runner = llm.engine.core.executor.worker.runner
        if static:  # 128 positions: 8 blocks, so the decode kernel splits them in two
            assert runner.capture_decode_graphs(8, 128, graphs=False)
            assert runner.decode_graphs.sizes == [1, 2, 4, 8]
        outputs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=3, temperature=0))
        outputs += llm.generate(PROMPTS, [SamplingParams(max_tokens=2 + i // 2, temperature=0) for i in range(6)])
        outputs += llm.generate([PROMPTS[1] + " And again"], SamplingParams(max_tokens=3, temperature=0))
        assert outputs[-1].num_cached_tokens > 0
        used = runner.decode_graphs is not None and runner.decode_graphs.slots[6:].eq(-1).all()
        return [o.outputs[0].token_ids for o in outputs], int(bool(used))
    finally:
        llm.shutdown()


def test_padded_static_decode_steps_give_the_eager_tokens() -> None:
    eager, _ = _run(static=False)
    padded, padding_left_unwritten = _run(static=True)
    assert padded == eager
    assert padding_left_unwritten


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(0) == []


def test_backends_without_padding_stay_eager() -> None:
    llm = LLM("smollm2-135m", attention_backend="torch", kv_cache_memory="64MiB", max_model_len=256)
    try:
        runner = llm.engine.core.executor.worker.runner
        assert not runner.capture_decode_graphs(8, 256, graphs=False)
        assert runner.decode_graphs is None
    finally:
        llm.shutdown()
