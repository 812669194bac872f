"""The decoder dimensions of a config.json, read once for the engine and the memory plan.

`ModelConfig.from_hf` (what the engine builds layers from) and `read_shape` (what
`tandem plan memory` counts bytes over) both take their dimensions from `read_decoder_dims`,
so a field one of them learns to read the other reads too.
"""

from __future__ import annotations

from typing import Any

import pytest

from tandem.config import ModelConfig
from tandem.sizing.errors import PlanError
from tandem.sizing.examples import load_config
from tandem.sizing.shape import read_shape


def engine_and_plan(config: dict[str, Any]) -> tuple[ModelConfig, Any]:
    return ModelConfig.from_hf(config), read_shape(config)


@pytest.mark.parametrize("name", ["kimi-k2", "deepseek-v3", "llama-3.1-70b", "qwen3-235b-a22b"])
def test_the_engine_and_the_plan_read_the_same_dimensions(name: str) -> None:
    _, config = load_config(name)
    engine, plan = engine_and_plan(config)
    assert (engine.vocab_size, engine.hidden_size, engine.num_hidden_layers, engine.num_attention_heads,
            engine.num_key_value_heads, engine.intermediate_size, engine.max_position_embeddings) == \
           (plan.vocab_size, plan.hidden_size, plan.num_layers, plan.num_heads,
            plan.num_kv_heads, plan.intermediate_size, plan.max_position_embeddings)
    assert (engine.tie_word_embeddings, engine.qkv_bias, engine.o_proj_bias, engine.qk_norm) == \
           (plan.tie_word_embeddings, plan.qkv_bias, plan.o_bias, plan.qk_norm)
    if plan.mla is None:
        assert engine.mla is None and engine.head_dim == plan.head_dim
    else:
        assert (engine.mla.kv_lora_rank, engine.mla.q_lora_rank, engine.mla.qk_rope_head_dim) == \
               (plan.mla.kv_lora_rank, plan.mla.q_lora_rank, plan.mla.qk_rope_head_dim)


def test_a_field_only_recent_configs_carry_reaches_both() -> None:
    """A null `max_position_embeddings` (some converted checkpoints write it) falls back the
    same way in both; before the shared reader the engine failed on it and the plan did not."""
    _, config = load_config("llama-3.1-70b")
    config["max_position_embeddings"] = None
    engine, plan = engine_and_plan(config)
    assert engine.max_position_embeddings == plan.max_position_embeddings == 4096


def test_an_mla_config_without_its_latent_rank_is_refused_by_the_plan() -> None:
    _, config = load_config("deepseek-v3")
    del config["kv_lora_rank"]
    with pytest.raises(PlanError, match="kv_lora_rank"):
        read_shape(config)
