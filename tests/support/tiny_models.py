"""Tiny random Hugging Face models of every family, saved with transformers, for parity tests
of split models (tensor / pipeline / expert parallelism) against transformers and one rank."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
DEEPSEEK = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                n_shared_experts=1, moe_intermediate_size=16)
CONFIGS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, vocab_size=96, tie_word_embeddings=False, attention_bias=True)),
    # an odd vocabulary: the last rank's share of the embedding and head is padded
    "qwen2-tied-odd-vocab": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, vocab_size=97, tie_word_embeddings=True)),
    # experts split by their intermediate size, one all-reduce after the combine
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, vocab_size=96, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    # latent attention split by head (the latent whole on each rank); 8 experts in 4 groups,
    # the best 2 groups eligible, top 2, a shared expert, the first layer dense
    "deepseek-v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**SMALL, "num_key_value_heads": 4}, vocab_size=96, **DEEPSEEK)),
    # 3 KV heads (2 query heads each) over 2 ranks: dealt 2 + 1 by KV group, as SmolLM2's are
    "llama-3-kv-heads": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**SMALL, "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3}, vocab_size=96)),
}


def save_tiny(name: str, directory: Path, with_tokenizer: bool = False) -> torch.nn.Module:
    """Build CONFIGS[name] with seeded random weights large enough to make routing and
    attention matter, save it to `directory`, and return the transformers model.

    `with_tokenizer` copies the default model's tokenizer beside it, so an engine can start on
    the directory (prompts are then given as token ids below the tiny vocabulary).
    """
    torch.manual_seed(0)
    model = CONFIGS[name]().eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in pname else 0.08 * torch.randn_like(param))
    model.save_pretrained(directory)
    if with_tokenizer:
        from tandem.loader.resolve import resolve_model

        source = resolve_model("smollm2-135m").hf_dir
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / file, directory / file)
    return model
