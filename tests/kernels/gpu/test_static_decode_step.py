"""Decode steps through `StaticDecodeStep`'s static buffers and padding, the part of the CUDA
graph path that is the same on every device: here the Triton kernels run interpreted on the
CPU and each "replay" is the forward run eagerly on the padded buffers (`graphs=False`).

Greedy tokens must equal the plain (torch backend) path's, with batch sizes that need padding (3 rows run as
the size-4 set, 6 as 8), a cached prefix, and requests finishing at different steps so
the batch shrinks between steps; padded rows must not write the cache (their slot is -1).

The model is a tiny random Llama (two layers, tests/support/tiny_models.py): what is checked is
the static buffers and padding around the kernels, which the depth of the model does not change,
and the interpreter runs each layer's kernels ~100x slower than the torch backend (the whole
default model's 30 layers took four minutes here on an AVX2-only box; test_triton_backend_model
holds the kernels on the default model).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.llm import LLM
from tandem.types import SamplingParams
from tandem.worker.cuda_graphs import capture_sizes
from tests.support.tiny_models import save_tiny

pytestmark = pytest.mark.slow

# Token ids below the tiny vocabulary (96), of different lengths; the second is the longest.
PROMPTS = [[5, 17, 33, 3, 40], [11, 12, 13, 14, 15, 16, 17] * 3, [1, 50, 1, 51, 1], [60, 61, 62, 63],
           [70, 9, 70, 9], [81, 82, 83, 84, 85, 86]]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny("llama", path, with_tokenizer=True)
    return path


def _run(model: Path, static: bool) -> tuple[list[list[int]], int]:
    # The plain path runs on the torch backend: test_triton_backend_model holds the Triton
    # kernels' tokens equal to it, and it is ~100x faster than the interpreter.
    llm = LLM(str(model), attention_backend="triton" if static else "torch", kv_cache_memory="64MiB", max_model_len=128,
              block_size=16)  # a GPU's default block: 128 positions are 8 blocks
    try:
        runner = llm.engine.core.executor.worker.runner
        if static:  # 128 positions: 8 blocks, so the decode kernel splits them in two
            assert runner.capture_decode_graphs(8, 128, graphs=False)
            assert runner.decode_graphs.sizes == [1, 2, 4, 8]
        greedy = {"temperature": 0, "ignore_eos": True}
        outputs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=3, **greedy))
        outputs += llm.generate(PROMPTS, [SamplingParams(max_tokens=2 + i // 2, **greedy) for i in range(6)])
        outputs += llm.generate([PROMPTS[1] + [20, 21, 22]], SamplingParams(max_tokens=3, **greedy))
        assert outputs[-1].num_cached_tokens > 0
        used = runner.decode_graphs is not None and runner.decode_graphs.slots[6:].eq(-1).all()
        return [o.outputs[0].token_ids for o in outputs], int(bool(used))
    finally:
        llm.shutdown()


def test_padded_static_decode_steps_give_the_eager_tokens(tiny_llama: Path) -> None:
    eager, _ = _run(tiny_llama, static=False)
    padded, padding_left_unwritten = _run(tiny_llama, static=True)
    assert padded == eager
    assert padding_left_unwritten


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(0) == []


def test_backends_without_padding_stay_eager(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), attention_backend="torch", kv_cache_memory="64MiB", max_model_len=128)
    try:
        runner = llm.engine.core.executor.worker.runner
        assert not runner.capture_decode_graphs(8, 128, graphs=False)
        assert runner.decode_graphs is None
    finally:
        llm.shutdown()
