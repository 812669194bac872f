"""The memory plan (`tandem.sizing`): parameter counts, KV sizes, sharding rules and the plan,
checked against published figures for the shipped example configs (no weights, no GPU).

Published figures used:
- Llama-3.1-70B: 70,553,706,496 parameters (the HF checkpoint's count).
- DeepSeek-V3: 671B total, 37B activated (DeepSeek-V3 report).
- Kimi-K2: 1T total / 32B activated (MoonshotAI/Kimi-K2 README); its FP8 checkpoint holds
  958.49 GiB of tensors (a dump of moonshotai/Kimi-K2-Instruct's 61 safetensors files).
- Qwen3-235B-A22B: 235B / 22B (the model name).
- Llama-4-Scout: 109B total with the vision tower / 17B active (Meta's model card).
- vLLM on one H100, Llama-3.1-8B, defaults: "total_gpu_memory (79.11GiB) x
  gpu_memory_utilization (0.90) = 71.20GiB; model weights take 14.99GiB; non_torch_memory
  takes 0.35GiB; PyTorch activation peak memory takes 1.24GiB; the rest of the memory
  reserved for KV Cache is 54.62GiB", "GPU KV cache size: 447,088 tokens".

Active-parameter figures are published rounded to a whole billion and their conventions
differ (input embedding in or out), so those are checked to 3%; totals to 1%.
"""

from __future__ import annotations

import pytest

from tandem.plan.report import format_memory_plan
from tandem.sizing.devices import GiB, parse_devices
from tandem.sizing.errors import PlanError
from tandem.sizing.examples import EXAMPLE_NAMES, EXAMPLES_DIR, load_config
from tandem.sizing.kv import kv_bytes_per_token
from tandem.sizing.memory import PlanRequest, plan_memory
from tandem.sizing.shape import read_shape
from tandem.sizing.sharding import (
    Parallel,
    WeightFormat,
    pp_layer_ranges,
    shard_shape,
    stage_weight_bytes,
    stages,
)
from tandem.sizing.tensors import Part, Split, Tensor, count_params

# meta-llama/Llama-3.1-8B's dimensions (the published config.json's shape fields).
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def shape_of(name: str):
    return read_shape(load_config(name)[1], name)


def plan(name: str | dict, devices: str, tp: int = 1, pp: int = 1, ep: bool = False, **kwargs):
    label, config = load_config(name) if isinstance(name, str) else ("inline", name)
    request = PlanRequest(parse_devices(devices), Parallel(tp, pp, ep), **kwargs)
    return plan_memory(config, request, label)


def within(value: float, published: float, tolerance: float) -> bool:
    return abs(value / published - 1) <= tolerance


# --- parameter counts -------------------------------------------------------------------

def test_every_example_config_is_readable() -> None:
    for name in EXAMPLE_NAMES:
        assert (EXAMPLES_DIR / name / "config.json").is_file()
        assert count_params(shape_of(name)).total > 7e9


def test_llama_3_1_70b_parameters_match_the_checkpoint() -> None:
    counts = count_params(shape_of("llama-3.1-70b"))
    assert counts.total == 70_553_706_496
    assert counts.active == counts.total  # dense
    assert counts.by_part["LM head"] == counts.by_part["embedding"] == 128256 * 8192


@pytest.mark.parametrize(("name", "total", "active"), [
    ("deepseek-v3", 671e9, 37e9),
    ("kimi-k2", 1.03e12, 32e9),
    ("qwen3-235b-a22b", 235e9, 22e9),
])
def test_moe_parameters_match_published_totals(name: str, total: float, active: float) -> None:
    counts = count_params(shape_of(name))
    assert within(counts.total, total, 0.01), counts.total
    assert within(counts.active, active, 0.03), counts.active


def test_llama_4_scout_counts_the_vision_tower_apart() -> None:
    counts = count_params(shape_of("llama-4-scout"))
    assert counts.vision == 871_932_416
    assert within(counts.total + counts.vision, 109e9, 0.01)
    assert within(counts.active, 17e9, 0.03)
    # 48 MoE layers of 16 experts + 1 shared expert, SwiGLU of width 8192 over hidden 5120
    assert counts.by_part["routed experts"] == 48 * 16 * 3 * 5120 * 8192
    assert counts.by_part["shared experts"] == 48 * 3 * 5120 * 8192


def test_kimi_k2_fp8_bytes_match_the_published_checkpoint() -> None:
    shape = shape_of("kimi-k2")
    assert shape.fp8_block == (128, 128) and shape.moe.num_experts == 384
    assert min(shape.moe.layers) == 1 and len(shape.moe.layers) == 60  # first layer dense
    (stage,) = stages(shape, Parallel())
    total = stage_weight_bytes(stage, Parallel(), WeightFormat("bfloat16", (128, 128)))
    assert within(total / GiB, 958.49, 0.001), total / GiB


# --- KV bytes per token -----------------------------------------------------------------

def test_mla_kv_is_one_latent_per_layer_and_does_not_shrink_with_tp() -> None:
    shape = shape_of("kimi-k2")
    for tp in (1, 8, 16):
        assert kv_bytes_per_token(shape, tp, 61, "bfloat16") == 576 * 61 * 2  # 68.6 KiB
    assert kv_bytes_per_token(shape, 8, 61, "fp8") == 576 * 61


def test_gqa_kv_splits_heads_until_tp_exceeds_them() -> None:
    shape = shape_of("llama-3.1-70b")
    assert kv_bytes_per_token(shape, 1, 80, "bfloat16") == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    assert kv_bytes_per_token(shape, 8, 80, "bfloat16") == 40 * 1024
    assert kv_bytes_per_token(shape, 16, 80, "bfloat16") == 40 * 1024  # replicated past 8 heads
    llama_8b = read_shape(LLAMA_8B)
    assert kv_bytes_per_token(llama_8b, 1, 32, "bfloat16") == 128 * 1024


# --- sharding rules ---------------------------------------------------------------------

def test_tensor_parallel_split_rules() -> None:
    tp8 = Parallel(tp=8)
    assert shard_shape(Tensor("q", Part.ATTENTION, 8192, 4096, Split.COLUMN), tp8) == (1024, 4096, 1)
    assert shard_shape(Tensor("o", Part.ATTENTION, 4096, 8192, Split.ROW), tp8) == (4096, 1024, 1)
    assert shard_shape(Tensor("emb", Part.EMBEDDING, 128256, 4096, Split.VOCAB), tp8) == (16032, 4096, 1)
    assert shard_shape(Tensor("norm", Part.NORMS, 4096), tp8) == (4096, 1, 1)
    k = Tensor("k", Part.ATTENTION, 4 * 128, 4096, Split.KV_HEADS, heads=4)
    assert shard_shape(k, Parallel(tp=2)) == (256, 4096, 1)
    assert shard_shape(k, tp8) == (128, 4096, 1)  # 4 heads over 8 ranks: one each, replicated
    experts = Tensor("w", Part.ROUTED_EXPERTS, 2048, 7168, Split.COLUMN, experts=384)
    assert shard_shape(experts, tp8) == (256, 7168, 384)  # TP: every expert sliced
    assert shard_shape(experts, Parallel(tp=8, ep=True)) == (2048, 7168, 48)  # EP: whole experts


def test_tp_divides_the_weights_but_not_the_replicated_parts() -> None:
    shape = shape_of("llama-3.1-70b")
    fmt = WeightFormat("bfloat16")
    (one,) = stages(shape, Parallel())
    (eight,) = stages(shape, Parallel(tp=8))
    whole = stage_weight_bytes(one, Parallel(), fmt)
    sharded = stage_weight_bytes(eight, Parallel(tp=8), fmt)
    norms = (2 * 80 + 1) * 8192 * 2
    assert whole == 70_553_706_496 * 2
    assert sharded == (whole - norms) // 8 + norms


def test_mla_down_projections_are_replicated() -> None:
    shape = shape_of("deepseek-v3")
    (stage,) = stages(shape, Parallel(tp=8))
    q_a = next(t for t in stage.tensors if t.name == "q_a_proj")
    kv_b = next(t for t in stage.tensors if t.name == "kv_b_proj")
    assert shard_shape(q_a, Parallel(tp=8)) == (1536, 7168, 1)
    assert shard_shape(kv_b, Parallel(tp=8)) == (128 * 256 // 8, 512, 1)


def test_pipeline_stages_split_layers_like_vllm() -> None:
    assert [len(r) for r in pp_layer_ranges(80, 3)] == [27, 27, 26]
    assert [len(r) for r in pp_layer_ranges(61, 4)] == [15, 15, 16, 15]
    shape = shape_of("llama-3.1-70b")
    first, middle, last = stages(shape, Parallel(pp=3))
    assert [t.name for t in first.tensors].count("embed_tokens") == 1
    assert "lm_head" not in [t.name for t in first.tensors + middle.tensors]
    assert [t.name for t in last.tensors][-2:] == ["norm", "lm_head"]


def test_expert_parallel_keeps_the_per_rank_bytes_but_changes_divisibility() -> None:
    tp_plan = plan("deepseek-v3", "8xH200", tp=8)
    ep_plan = plan("deepseek-v3", "8xH200", tp=8, ep=True)
    tp_weights = tp_plan.tandem.stages[0].weight_bytes
    assert within(ep_plan.tandem.stages[0].weight_bytes, tp_weights, 0.001)
    with pytest.raises(PlanError, match="192 per rank at tp 8"):
        plan("qwen3-235b-a22b", "8xH200", tp=8, dtype="fp8")
    assert plan("qwen3-235b-a22b", "8xH200", tp=8, dtype="fp8", ep=True).tandem.fits


# --- plans --------------------------------------------------------------------------------

def test_llama_4_scout_on_two_h200_leaves_more_than_56_gib_for_kv() -> None:
    result = plan("llama-4-scout", "2xH200", tp=2)
    assert result.tandem.kv_bytes_total > 56 * GiB
    (stage,) = result.tandem.stages
    assert stage.ranks == 2 and stage.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2
    assert result.vllm is not None and result.vllm.kv_bytes_total < result.tandem.kv_bytes_total


def test_vllm_column_reproduces_vllms_published_llama_8b_kv_cache() -> None:
    result = plan(LLAMA_8B, "1xH100")
    (stage,) = result.vllm.stages
    assert (result.vllm.max_num_batched_tokens, result.vllm.max_num_seqs) == (8192, 1024)
    assert within(stage.weight_bytes / GiB, 14.99, 0.01)
    assert within(stage.activation_bytes / GiB, 1.24, 0.15)
    assert within(stage.kv_bytes / GiB, 54.62, 0.01)
    assert within(result.vllm.kv_tokens, 447_088, 0.01)


def test_kimi_k2_on_eight_h200() -> None:
    result = plan("kimi-k2", "8xH200", tp=8)
    (stage,) = result.tandem.stages
    assert stage.kv_bytes_per_token == 576 * 61 * 2
    assert 0 < stage.kv_bytes < 16 * GiB
    assert result.max_model_len == 131072 and result.tandem.max_sequences(131072) == 0
    assert any("does not fit" in note for note in result.notes)
    fp8_kv = plan("kimi-k2", "8xH200", tp=8, kv_cache_dtype="fp8")
    assert fp8_kv.tandem.kv_tokens >= 2 * result.tandem.kv_tokens - 16


def test_cpu_device_has_no_cuda_overhead_and_no_vllm_column() -> None:
    result = plan(LLAMA_8B, "cpu:24GiB", max_model_len=8192)
    (stage,) = result.tandem.stages
    assert stage.reserved_bytes == 0 and result.vllm is None
    assert stage.kv_bytes == int(0.92 * 24 * GiB) - stage.weight_bytes
    assert "no comparison on a CPU device" in format_memory_plan(result)


@pytest.mark.parametrize(("args", "message"), [
    (("deepseek-v3", "3xH200", 3), "tp 3 does not divide the 128 attention heads"),
    (("llama-3.1-70b", "1xH100", 1), "short by"),
    (("llama-3.1-70b", "4xH100", 2), "4 device(s), but tp 2"),
])
def test_bad_plans_say_why(args: tuple, message: str) -> None:
    with pytest.raises(PlanError) as info:
        plan(*args)
    assert message in str(info.value)


def test_unsupported_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(PlanError, match="supported: LlamaForCausalLM.*DeepseekV3ForCausalLM"):
        read_shape({"architectures": ["GPT2LMHeadModel"]})


def test_an_int8_cache_plans_its_rows_and_their_scales() -> None:
    """--kv-cache-dtype int8: head_dim int8 values and a 4-byte scale per cached row, as
    kernels/kv_format.py stores them; on a GPU there is no vLLM column (vLLM has no int8 KV)."""
    llama = read_shape(LLAMA_8B)
    assert kv_bytes_per_token(llama, 1, 32, "int8") == 32 * 2 * 8 * (128 + 4)
    assert kv_bytes_per_token(llama, 4, 32, "int8") == 32 * 2 * 2 * (128 + 4)
    kimi = read_shape(load_config("kimi-k2")[1])
    assert kv_bytes_per_token(kimi, 8, 61, "int8") == 61 * (576 + 4)  # one latent row a layer
    bf16 = plan(LLAMA_8B, "cpu:24GiB", max_model_len=8192, kv_cache_dtype="bfloat16")
    int8 = plan(LLAMA_8B, "cpu:24GiB", max_model_len=8192, kv_cache_dtype="int8")
    assert int8.kv_cache_dtype == "int8"
    assert int8.tandem.kv_tokens / bf16.tandem.kv_tokens == pytest.approx(256 / 132, rel=0.01)
    gpu = plan(LLAMA_8B, "1xH100", kv_cache_dtype="int8")  # the Triton kernels read it too
    fp8 = plan(LLAMA_8B, "1xH100", kv_cache_dtype="fp8")
    assert gpu.vllm is None and any("vLLM has no int8 KV cache" in note for note in gpu.notes)
    assert gpu.tandem.kv_tokens / fp8.tandem.kv_tokens == pytest.approx(128 / 132, rel=0.01)
