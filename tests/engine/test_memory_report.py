"""The memory split an engine logs at start holds the plan's arithmetic for each dtype: the
weights it measures on the rank beside the plan's, and its KV bytes per token equal to the
plan's for the model's-dtype cache and an int8 one.

One difference, pinned here to the byte: on a CPU that packs the dtype's weights (fp32
always, bf16 where oneDNN has a bf16 GEMM) a tied LM head (SmolLM2's) is kept a second time,
packed beside the embedding rows the lookup reads, which the plan (one copy of a tied matrix,
as on a GPU) does not count: vocab x hidden x the dtype's bytes, 113 MB of SmolLM2's 651 MB in
fp32. An AVX2-only CPU has no bf16 GEMM: its bf16 matrices stay plain rows, read by the GEMV
kernel, and the head is the embedding's one copy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.engine.memory_report import memory_split_lines
from tandem.layers.linear import onednn_bf16_available
from tandem.llm import LLM
from tandem.sizing.devices import parse_devices
from tandem.sizing.memory import PlanRequest, plan_memory

pytestmark = pytest.mark.slow



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "int8"])
def test_the_logged_split_matches_the_plan(dtype: str, kv_cache_dtype: str) -> None:
    # One copy of the weights, as the plan counts them (--exact's fp32 GEMV rows are a second).
    with LLM("smollm2-135m", dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory="16MiB",
             decode_weights="none") as llm:
        core = llm.engine.core
        info = core.worker_infos[0]
        hf = json.loads((Path(info.hf_dir) / "config.json").read_text())
        plan = plan_memory(hf, PlanRequest(parse_devices("cpu:16GiB"), dtype=dtype,
                                           kv_cache_dtype=kv_cache_dtype)).tandem
        stage = plan.stages[0]
        assert hf["tie_word_embeddings"]
        head_packed = dtype == "float32" or onednn_bf16_available()
        packed_head = hf["vocab_size"] * hf["hidden_size"] * {"float32": 4, "bfloat16": 2}[dtype] * head_packed
        assert info.weight_bytes == stage.weight_bytes + packed_head
        assert info.block_bytes == stage.kv_bytes_per_token * core.config.cache.block_size
        line = memory_split_lines(core.config, core.worker_infos, core.num_blocks)[0]
        per_token = stage.kv_bytes_per_token / 1024
        assert f"at {per_token:.1f} KiB/token" in line and f"planned: weights {stage.weight_bytes / (1 << 30):.2f} GiB" in line
