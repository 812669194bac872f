"""Kimi K2.5 in the memory plan: the nested KimiK25ForConditionalGeneration config, and the
compressed-tensors pack-quantized INT4 experts counted byte for byte.

The reference is a dump of the published checkpoint (moonshotai/Kimi-K2.5: 64 safetensors
files, 208,550 tensors, 170,738,182,128 stored numbers, "554.27 GB" of tensors, GiB in fact),
whose per-tensor table is transcribed in `CHECKPOINT` below; every expected figure here is
computed from that table, not from the planner.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from tandem.sizing.devices import GiB, parse_devices
from tandem.sizing.errors import PlanError
from tandem.sizing.examples import load_config
from tandem.sizing.memory import PlanRequest, plan_memory, vision_weight_bytes
from tandem.sizing.quant import read_compressed_tensors
from tandem.sizing.shape import read_shape
from tandem.sizing.sharding import (
    Parallel,
    WeightFormat,
    quantized_parts,
    stage_weight_bytes,
    stages,
)

BF16, I32, F32 = 2, 4, 4
EXPERTS = 60 * 384  # 60 MoE layers (the first of 61 is dense) x 384 routed experts
SPLIT, WHOLE, PER_EXPERT = "split", "whole", "expert"  # how tp 8 / EP deal the tensor out

# (name, shape, bytes per number, how many, how tensor parallelism places it): the dump's table.
TEXT = [
    ("lm_head", (163840, 7168), BF16, 1, SPLIT),
    ("embed_tokens", (163840, 7168), BF16, 1, SPLIT),
    ("input_layernorm", (7168,), BF16, 61, WHOLE),
    ("post_attention_layernorm", (7168,), BF16, 61, WHOLE),
    ("self_attn.kv_a_layernorm", (512,), BF16, 61, WHOLE),
    ("self_attn.kv_a_proj_with_mqa", (576, 7168), BF16, 61, WHOLE),
    ("self_attn.kv_b_proj", (16384, 512), BF16, 61, SPLIT),
    ("self_attn.o_proj", (7168, 8192), BF16, 61, SPLIT),
    ("self_attn.q_a_layernorm", (1536,), BF16, 61, WHOLE),
    ("self_attn.q_a_proj", (1536, 7168), BF16, 61, WHOLE),
    ("self_attn.q_b_proj", (12288, 1536), BF16, 61, SPLIT),
    ("layers.0.mlp.down_proj", (7168, 18432), BF16, 1, SPLIT),
    ("layers.0.mlp.gate_proj", (18432, 7168), BF16, 1, SPLIT),
    ("layers.0.mlp.up_proj", (18432, 7168), BF16, 1, SPLIT),
    ("experts.down_proj.weight_packed", (7168, 256), I32, EXPERTS, PER_EXPERT),
    ("experts.down_proj.weight_scale", (7168, 64), BF16, EXPERTS, PER_EXPERT),
    ("experts.down_proj.weight_shape", (2,), I32, EXPERTS, PER_EXPERT),
    ("experts.gate_proj.weight_packed", (2048, 896), I32, EXPERTS, PER_EXPERT),
    ("experts.gate_proj.weight_scale", (2048, 224), BF16, EXPERTS, PER_EXPERT),
    ("experts.gate_proj.weight_shape", (2,), I32, EXPERTS, PER_EXPERT),
    ("experts.up_proj.weight_packed", (2048, 896), I32, EXPERTS, PER_EXPERT),
    ("experts.up_proj.weight_scale", (2048, 224), BF16, EXPERTS, PER_EXPERT),
    ("experts.up_proj.weight_shape", (2,), I32, EXPERTS, PER_EXPERT),
    ("mlp.gate.e_score_correction_bias", (384,), F32, 60, WHOLE),
    ("mlp.gate.weight", (384, 7168), BF16, 60, WHOLE),
    ("shared_experts.down_proj", (7168, 2048), BF16, 60, SPLIT),
    ("shared_experts.gate_proj", (2048, 7168), BF16, 60, SPLIT),
    ("shared_experts.up_proj", (2048, 7168), BF16, 60, SPLIT),
    ("norm", (7168,), BF16, 1, WHOLE),
]
VISION = [  # mm_projector.* and vision_tower.*, all bfloat16
    ("mm_projector.pre_norm.bias", (1152,), 1), ("mm_projector.pre_norm.weight", (1152,), 1),
    ("mm_projector.proj.0.bias", (4608,), 1), ("mm_projector.proj.0.weight", (4608, 4608), 1),
    ("mm_projector.proj.2.bias", (7168,), 1), ("mm_projector.proj.2.weight", (7168, 4608), 1),
    ("blocks.mlp.fc0.bias", (4304,), 27), ("blocks.mlp.fc0.weight", (4304, 1152), 27),
    ("blocks.mlp.fc1.bias", (1152,), 27), ("blocks.mlp.fc1.weight", (1152, 4304), 27),
    ("blocks.norm0.bias", (1152,), 27), ("blocks.norm0.weight", (1152,), 27),
    ("blocks.norm1.bias", (1152,), 27), ("blocks.norm1.weight", (1152,), 27),
    ("blocks.wo.bias", (1152,), 27), ("blocks.wo.weight", (1152, 1152), 27),
    ("blocks.wqkv.bias", (3456,), 27), ("blocks.wqkv.weight", (3456, 1152), 27),
    ("encoder.final_layernorm.bias", (1152,), 1), ("encoder.final_layernorm.weight", (1152,), 1),
    ("patch_embed.pos_emb.weight", (64, 64, 1152), 1),
    ("patch_embed.proj.bias", (1152,), 1), ("patch_embed.proj.weight", (1152, 3, 14, 14), 1),
]


def text_bytes(tp: int = 1, ep: bool = False) -> int:
    """Bytes one rank holds of the text model, from the table: `split` tensors 1/tp each (every
    split is exact at tp 8), `whole` ones replicated, per-expert tensors 1/tp of every expert's
    data under TP (their weight_shape whole), 1/tp of the experts under EP."""
    total = 0
    for name, shape, size, count, how in TEXT:
        nbytes = math.prod(shape) * size * count
        if how == SPLIT or (how == PER_EXPERT and (ep or not name.endswith("weight_shape"))):
            nbytes //= tp
        total += nbytes
    return total


def vision_bytes() -> int:
    return sum(math.prod(shape) * count for _, shape, count in VISION) * BF16


def k25() -> dict[str, Any]:
    return load_config("kimi-k2.5")[1]


def plan(config: dict, devices: str, tp: int, ep: bool = False, **kwargs):
    return plan_memory(config, PlanRequest(parse_devices(devices), Parallel(tp, 1, ep), **kwargs), "kimi-k2.5")


def test_the_transcribed_table_is_the_dumped_checkpoint() -> None:
    """The table's totals are the dump's header: 170,738,182,128 stored numbers, 554.27 GiB."""
    stored = (sum(math.prod(shape) * count for _, shape, _, count, _ in TEXT)
              + sum(math.prod(shape) * count for _, shape, count in VISION))
    assert stored == 170_738_182_128
    assert round((text_bytes() + vision_bytes()) / GiB, 2) == 554.27
    # the dump's per-projection totals: 157.50 GB packed and 19.69 GB of scales over 60 x 384
    assert round(EXPERTS * 2048 * 896 * I32 / GiB, 2) == 157.50
    assert round(EXPERTS * 2048 * 224 * BF16 / GiB, 2) == 19.69


# --- one expert matrix ----------------------------------------------------------------------

def test_one_int4_expert_matrix() -> None:
    """gate_proj [2048, 7168]: int32 [2048, 896] + bf16 [2048, 224] + int32 [2] = 4.5 bits a weight."""
    (scheme,) = read_compressed_tensors(k25()["quantization_config"]).schemes
    assert (scheme.num_bits, scheme.strategy, scheme.group_size, scheme.symmetric) == (4, "group", 32, True)
    gate = scheme.matrix_bytes(2048, 7168, BF16)
    assert gate == 2048 * 896 * I32 + 2048 * 224 * BF16 + 2 * I32 == 8_257_544
    assert scheme.matrix_bytes(7168, 2048, BF16) == 7168 * 256 * I32 + 7168 * 64 * BF16 + 2 * I32
    assert (gate - 8) * 8 / (2048 * 7168) == 4.5
    # one rank's slice at tp 8: a column slice keeps every group, a row slice whole groups
    assert scheme.matrix_bytes(256, 7168, BF16) == 256 * 896 * I32 + 256 * 224 * BF16 + 8
    assert scheme.matrix_bytes(7168, 256, BF16) == 7168 * 32 * I32 + 7168 * 8 * BF16 + 8


@pytest.mark.parametrize(("symmetric", "strategy", "group_size", "rows", "cols"), [
    (True, "group", 32, 2048, 7168),  # Kimi K2.5's expert
    (False, "group", 32, 100, 96),  # zero points packed 8 rows a word: 13 words for 100 rows
    (False, "channel", None, 100, 96),
    (True, "group", 128, 64, 256),
])
def test_matrix_bytes_match_what_compressed_tensors_writes(symmetric: bool, strategy: str, group_size: int | None,
                                                           rows: int, cols: int) -> None:
    """The formula against the compressed-tensors package's own pack-quantized compressor (the
    tool that wrote the checkpoint). Its weight_shape is int64 in this version; the published
    checkpoint's is int32 [2] (8 bytes, the dump's 180 KB over 23,040 experts), as counted."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size)
    groups = cols // group_size if group_size else 1
    state = {"weight": torch.randn(rows, cols, dtype=torch.bfloat16),
             "weight_scale": torch.rand(rows, groups, dtype=torch.bfloat16) + 0.1}
    if not symmetric:
        state["weight_zero_point"] = torch.zeros(rows, groups, dtype=torch.int8)
    out = PackedQuantizationCompressor.compress(state, QuantizationScheme(targets=["Linear"], weights=args))
    written = sum(t.numel() * t.element_size() for name, t in out.items() if name != "weight_shape")
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric,
                                           "strategy": strategy, "group_size": group_size}}}}
    (scheme,) = read_compressed_tensors(config).schemes
    assert scheme.matrix_bytes(rows, cols, BF16) == written + 2 * I32


# --- the whole checkpoint -------------------------------------------------------------------

def test_the_whole_k25_checkpoint_is_counted_to_the_byte() -> None:
    shape = read_shape(k25(), "kimi-k2.5")
    fmt = WeightFormat("bfloat16", None, shape.int_quant)
    (stage,) = stages(shape, Parallel())
    text = stage_weight_bytes(stage, Parallel(), fmt)
    assert text == text_bytes()
    assert vision_weight_bytes(shape, fmt) == vision_bytes() == 942_287_840
    assert text + vision_weight_bytes(shape, fmt) == 595_148_192_736  # 554.27 GiB
    assert quantized_parts(shape, fmt) == ["routed experts"]


@pytest.mark.parametrize("ep", [False, True])
def test_each_rank_at_tp8_holds_its_share_of_the_checkpoint(ep: bool) -> None:
    result = plan(k25(), "8xH200", 8, ep)
    (tandem,), (vllm,) = result.tandem.stages, result.vllm.stages
    assert tandem.weight_bytes == text_bytes(8, ep)
    assert tandem.vision_bytes == 0  # tandem serves the text decoder
    assert vllm.vision_bytes == vision_bytes() and vllm.weight_bytes == text_bytes(8, ep) + vision_bytes()


# --- the nested config ----------------------------------------------------------------------

def test_the_nested_config_reads_as_kimi_k2s_decoder() -> None:
    shape, k2 = read_shape(k25()), read_shape(load_config("kimi-k2")[1])
    assert shape.architecture == "KimiK25ForConditionalGeneration"
    same = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
            "tie_word_embeddings", "mla", "moe", "dtype", "mtp_layers")
    assert {f: getattr(shape, f) for f in same} == {f: getattr(k2, f) for f in same}
    assert (shape.hidden_size, shape.num_layers, shape.vocab_size) == (7168, 61, 163840)
    assert (shape.moe.num_experts, shape.moe.top_k, shape.moe.expert_intermediate) == (384, 8, 2048)
    assert shape.moe.layers == frozenset(range(1, 61)) and shape.intermediate_size == 18432
    assert (shape.mla.q_lora_rank, shape.mla.kv_lora_rank, shape.mla.qk_rope_head_dim) == (1536, 512, 64)
    assert shape.max_position_embeddings == 262144 and shape.fp8_block is None
    assert shape.vision.params == 471_143_920 and shape.vision.loaded_by_vllm  # 416,866,032 + 54,277,888


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_the_quantization_config_is_read_from_either_level(where: str) -> None:
    config = k25()
    drop = config["text_config"] if where == "top" else config
    del drop["quantization_config"]
    assert read_shape(config).int_quant == read_shape(k25()).int_quant is not None


def test_the_wrappers_tie_word_embeddings_decides() -> None:
    config = k25()
    config["tie_word_embeddings"] = True
    tied = plan(config, "8xH200", 8).tandem.stages[0].weight_bytes
    assert plan(k25(), "8xH200", 8).tandem.stages[0].weight_bytes - tied == 163840 * 7168 * BF16 // 8


def test_an_asymmetric_scheme_counts_packed_zero_points() -> None:
    config = k25()
    for quant in (config["quantization_config"], config["text_config"]["quantization_config"]):
        quant["config_groups"]["group_0"]["weights"]["symmetric"] = False
    shape = read_shape(config)
    fmt = WeightFormat("bfloat16", None, shape.int_quant)
    (stage,) = stages(shape, Parallel())
    zero_points = EXPERTS * (2 * (2048 // 8) * 224 + (7168 // 8) * 64) * I32
    assert stage_weight_bytes(stage, Parallel(), fmt) == text_bytes() + zero_points


def test_a_row_slice_that_splits_a_group_is_refused_unless_experts_stay_whole() -> None:
    config = k25()
    config["text_config"]["moe_intermediate_size"] = 96  # 48 input columns of down_proj per rank at tp 2
    with pytest.raises(PlanError, match="whole groups on each rank: experts.down_proj has 96 input columns, "
                                        "48 per rank at tp 2, not a multiple of 32; --ep keeps experts whole"):
        plan(config, "2xH200", 2)
    assert plan(config, "2xH200", 2, ep=True).tandem.fits


# --- what the plan refuses ------------------------------------------------------------------

def weights(**change: Any) -> dict:
    config = k25()
    for quant in (config["quantization_config"], config["text_config"]["quantization_config"]):
        quant["config_groups"]["group_0"]["weights"].update(change)
    return config


def quant(**change: Any) -> dict:
    config = k25()
    for q in (config["quantization_config"], config["text_config"]["quantization_config"]):
        q.update(change)
    return config


def group(**change: Any) -> dict:
    config = k25()
    for q in (config["quantization_config"], config["text_config"]["quantization_config"]):
        q["config_groups"]["group_0"].update(change)
    return config


@pytest.mark.parametrize(("config", "message"), [
    (weights(num_bits=3), "group_0 num_bits 3"),
    (weights(type="float", num_bits=4), "group_0 weights of type 'float'"),
    (weights(strategy="tensor"), "group_0 strategy 'tensor'"),
    (weights(strategy="block", block_structure=[128, 128]), "group_0 strategy 'block'"),
    (weights(actorder="static"), "group_0 actorder 'static'"),
    (weights(dynamic=True), "group_0 dynamic weights"),
    (quant(format="nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized'"),
    (quant(format="float-quantized"), "format 'float-quantized'"),
    (quant(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    (quant(quantization_status="frozen"), "quantization_status 'frozen'"),
    (group(input_activations={"num_bits": 8, "type": "int", "dynamic": False}), "static input_activations"),
    (group(targets=["Embedding"]), "rule 'Embedding' (a module class other than Linear)"),
])
def test_a_scheme_the_plan_cannot_size_is_refused_by_name(config: dict, message: str) -> None:
    with pytest.raises(PlanError) as info:
        read_shape(config)
    assert message in str(info.value) and "compressed-tensors" in str(info.value)


def test_compressed_tensors_on_an_architecture_whose_names_it_does_not_match_is_refused() -> None:
    config = copy.deepcopy(load_config("qwen3-235b-a22b")[1])
    config["quantization_config"] = k25()["quantization_config"]
    with pytest.raises(PlanError, match="compressed-tensors checkpoints of Qwen3MoeForCausalLM are not supported"):
        read_shape(config)


def test_rules_that_pick_some_experts_are_refused() -> None:
    config = quant(ignore=["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                           "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*experts\\.0\\..*"])
    with pytest.raises(PlanError, match="quantize some routed experts of model.layers.1.mlp.experts.\\*.gate_proj"):
        plan(config, "8xH200", 8)


def test_without_the_ignore_rules_every_linear_is_int4() -> None:
    """What the ignore list keeps bf16: with it empty, attention, the dense and shared MLPs and
    the LM head are packed too (the router, DeepSeek's MoEGate, is no nn.Linear)."""
    shape = read_shape(quant(ignore=[]))
    fmt = WeightFormat("bfloat16", None, shape.int_quant)
    assert quantized_parts(shape, fmt) == ["attention", "dense MLP", "routed experts", "shared experts", "LM head"]
