"""Perplexity through the engine's paged path: decode steps and chunked steps agree."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tandem import LLM
from tandem.bench.perplexity import perplexity

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
}


def test_perplexity_same_through_decode_and_chunked_steps(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    llm = LLM(str(tmp_path), load_format="dummy", kv_cache_memory="8MiB")
    tokens = [(7 * i + 3) % 64 for i in range(90)]
    one_at_a_time = perplexity(llm.engine, tokens, step_tokens=1)
    chunked = perplexity(llm.engine, tokens, step_tokens=32)
    assert math.isfinite(one_at_a_time) and one_at_a_time > 1.0
    assert one_at_a_time == pytest.approx(chunked, rel=1e-4)
    # random weights over 64 tokens are close to uniform: perplexity near the vocabulary size
    assert 16 < one_at_a_time < 256
    pool = llm.engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    with pytest.raises(ValueError, match="two tokens"):
        perplexity(llm.engine, [1], step_tokens=1)


def test_int8_on_the_default_model_runs_its_projections_in_8_bits() -> None:
    """--quantization int8 on real weights, fp32 and bf16: the decoder projections hold 8-bit
    copies (not the gate/up, not the LM head), and the passage's perplexity stays near exact
    fp32's through one-token steps and 64-token chunks. Near, not within 1%: its quality,
    measured by `tandem bench perplexity` on 3,700 tokens, is +2.5% (README, Performance); a
    wrong kernel or layout puts it in the hundreds."""
    from tandem.bench.perplexity import REFERENCE_TEXT

    exact = LLM(kv_cache_memory="64MiB")
    tokens = exact.tokenizer.encode(REFERENCE_TEXT)
    reference = perplexity(exact.engine, tokens, step_tokens=1)
    del exact
    for dtype in ("float32", "bfloat16"):
        int8 = LLM(kv_cache_memory="64MiB", dtype=dtype, quantization="int8")
        layers = int8.engine.runner.model.model.layers
        assert layers[0].self_attn.qkv_proj.int8 is not None and layers[0].mlp.down_proj.int8 is not None
        assert layers[0].mlp.gate_up_proj.int8 is None and int8.engine.runner.model.lm_head.int8 is None
        for step_tokens in (1, 64):
            assert perplexity(int8.engine, tokens, step_tokens) == pytest.approx(reference, rel=0.05), dtype
        del int8


def test_an_unknown_quantization_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(ValueError, match="--quantization must be none or int8"):
        LLM(str(tmp_path), load_format="dummy", kv_cache_memory="8MiB", quantization="int4")
