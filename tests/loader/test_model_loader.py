"""Dummy weights for a bare config, and clear errors for configs we cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.loader.model_loader import read_model_config

TINY = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "eos_token_id": 0,
}


def _config_dir(tmp_path: Path, **overrides: object) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**TINY, **overrides}))
    return tmp_path


def test_dummy_weights_run_any_config(tmp_path: Path) -> None:
    llm = LLM(str(_config_dir(tmp_path)), load_format="dummy", kv_cache_memory="8MiB")
    assert llm.tokenizer is None
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5
    again = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    pool = llm.engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_missing_weights_are_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="safetensors"):  # the model loads before the tokenizer
        LLM(str(_config_dir(tmp_path)), kv_cache_memory="8MiB")


def test_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        read_model_config(_config_dir(tmp_path, architectures=["GPT2LMHeadModel"]))


def test_unsupported_rope_scaling_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="RoPE scaling type 'longrope'"):
        read_model_config(_config_dir(tmp_path, rope_scaling={"rope_type": "longrope", "factor": 4.0}))


def test_kv_budget_too_small(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv-cache-memory"):
        LLM(str(_config_dir(tmp_path)), load_format="dummy", kv_cache_memory=100)


def test_unknown_dtype_lists_supported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dtype must be one of float32"):
        LLM(str(_config_dir(tmp_path)), load_format="dummy", dtype="fp8", kv_cache_memory="8MiB")


def test_kv_spec_sizes_the_cache_blocks(tmp_path: Path) -> None:
    from tandem.worker.model_runner import kv_bytes_per_block

    config = read_model_config(_config_dir(tmp_path))
    spec = config.kv_spec
    assert (spec.num_planes, spec.num_heads, spec.head_dim) == (2, 2, 8)
    # keys and values x 2 layers x 2 KV heads x 8 dims x 16 tokens x 4 bytes (fp32)
    assert kv_bytes_per_block(config, 16, torch.float32) == 2 * 2 * 2 * 8 * 16 * 4


def test_a_deepseek_v3_config_runs_with_dummy_weights_on_a_latent_cache(tmp_path: Path) -> None:
    """The whole engine on MLA + grouped MoE: blocks sized for the 1-plane latent, prefix hits."""
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 64,
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 16, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8, "n_group": 4,
        "topk_group": 2, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "max_position_embeddings": 256, "eos_token_id": 0,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_model_config(tmp_path).kv_spec.values_per_token(3) == 3 * (16 + 8)
    llm = LLM(str(tmp_path), load_format="dummy", kv_cache_memory="4MiB", block_size=16)  # 39 tokens: 2 whole blocks
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = list(range(1, 40))
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens >= 32  # whole blocks of the latent cache were reused
    pool = llm.engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_place_on_device_keeps_buffers_small_params_and_ties() -> None:
    """The GPU build's move (here to the CPU in bf16, the same code): the rotary tables and
    the norms' ones keep their values, big weights get fresh storage of the right dtype and
    shape without reading the old, and a tied head stays the embedding's tensor."""
    import torch

    from tandem.config import ModelConfig
    from tandem.kernels.torch_attention import TorchAttentionBackend
    from tandem.loader.model_loader import _KEEP_VALUES_BYTES, place_on_device
    from tandem.models.registry import model_class

    config = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 1024,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    model = model_class(config.architecture)(config, TorchAttentionBackend(), 128, torch.bfloat16)
    cos = model.rotary.cos.clone()
    big = model.model.layers[0].mlp.gate_up_proj.weight
    assert big.numel() * 4 >= _KEEP_VALUES_BYTES
    placed = place_on_device(model, torch.device("cpu"), torch.bfloat16)
    assert placed.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    assert placed.model.layers[0].input_layernorm.weight.eq(1).all()
    assert torch.equal(placed.rotary.cos, cos)
    moved = placed.model.layers[0].mlp.gate_up_proj.weight
    assert moved.dtype == torch.bfloat16 and moved.shape == big.shape
    assert moved.untyped_storage().data_ptr() != big.untyped_storage().data_ptr()
    assert placed.lm_head.weight is placed.model.embed_tokens.weight
