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


def test_int8_on_the_default_model_stays_within_1_percent_of_fp32() -> None:
    """--quantization int8 on real weights, fp32 and bf16: every decoder projection holds an
    8-bit copy (the gate/up and the LM head too), and perplexity over 2,048 tokens of
    docstrings in 64-token chunks stays within 1% of exact fp32's (`tandem bench perplexity`
    over ~3,700 on the 2-core EPYC: +0.16% and +0.14%; +2.5% before each row's outliers were
    kept exact; with all of them the test took 7 minutes on an AVX2-only box, so it reads the
    first 2,048: +0.45% and +0.66% there). One-token steps, the decode path, are checked near
    it on the short passage's first 128 tokens (-2.0% and -1.1% there; each step is a whole
    forward and full-vocabulary logits)."""
    from tandem.bench.perplexity import REFERENCE_TEXT, long_text

    exact = LLM(kv_cache_memory="256MiB")
    tokens = exact.tokenizer.encode(long_text())[:2048]
    passage = exact.tokenizer.encode(REFERENCE_TEXT)[:128]
    reference = perplexity(exact.engine, tokens, step_tokens=64)
    passage_reference = perplexity(exact.engine, passage, step_tokens=1)
    del exact
    for dtype in ("float32", "bfloat16"):
        int8 = LLM(kv_cache_memory="256MiB", dtype=dtype, quantization="int8")
        model = int8.engine.runner.model
        layers = model.model.layers
        assert all(layer.self_attn.qkv_proj.int8 is not None and layer.mlp.gate_up_proj.int8 is not None
                   and layer.mlp.down_proj.int8 is not None for layer in layers)
        assert model.lm_head.int8 is not None
        assert perplexity(int8.engine, tokens, 64) == pytest.approx(reference, rel=0.01), dtype
        assert perplexity(int8.engine, passage, 1) == pytest.approx(passage_reference, rel=0.05), dtype
        del int8


def test_an_unknown_quantization_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(ValueError, match="--quantization must be none, int8 or w8a16"):
        LLM(str(tmp_path), load_format="dummy", kv_cache_memory="8MiB", quantization="int4")


def test_mode_subsets_always_start_from_exact_fp32() -> None:
    from tandem.bench.perplexity_cli import MODES, _chosen_modes

    assert _chosen_modes(None) == list(MODES.values())
    assert [label for label, _ in _chosen_modes("fp32+fp32, bf16")] == [
        "fp32 (exact)", "fp32 + fp32 decode weights", "bf16"]
    assert _chosen_modes("fp32") == [MODES["fp32"]]
    with pytest.raises(ValueError, match="unknown mode fp8"):
        _chosen_modes("fp8")


def test_an_unknown_mode_fails_at_parse_time(capsys) -> None:
    from tandem.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["bench", "perplexity", "--modes", "bf16,fp8"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("tandem: error: --modes: unknown mode fp8; choose from")


def test_the_fp8_rounding_divides_by_each_layers_scales_before_it_rounds() -> None:
    """`--kv-dtypes fp8`: what an fp8 cache keeps of each value. A layer scaled by 8 keeps
    values up to 2,000 (e4m3 tops out at 448 unscaled); every value comes back within e4m3's relative step
    (2^-4 of it) or half its subnormal step, both times the layer's scale."""
    import torch

    from tandem.bench.perplexity import Fp8Rounding

    blocks = torch.randn(2, 2, 3, 4, 16, 64, generator=torch.Generator().manual_seed(0))
    blocks[1, 1] *= 500.0
    rounding = Fp8Rounding(((1.0, 1.0), (0.5, 8.0)))
    back = rounding.roundtrip(blocks)
    assert back.dtype == blocks.dtype and back.shape == blocks.shape
    assert not torch.equal(back, blocks)
    error = (back - blocks).abs()
    subnormal = torch.tensor(rounding.scales).view(2, 2, 1, 1, 1, 1) * 2**-10  # half of e4m3's 2^-9, scaled
    assert bool((error <= blocks.abs() * 2**-4 + subnormal).all())
    assert blocks[1, 1].abs().max() > 448 and (back[1, 1] - blocks[1, 1]).abs().max() < 100
    clamped = Fp8Rounding(((1.0, 1.0), (1.0, 1.0))).roundtrip(blocks)
    assert clamped[1, 1].abs().max() == 448  # scale 1.0 saturates the same values
    assert rounding.payload_bytes((2, 2, 3, 4, 16, 64), torch.float32) == 2 * 2 * 3 * 4 * 16 * 64


def test_the_scales_are_measured_through_the_layers_where_the_c_stack_takes_prefills() -> None:
    """`--kv-dtypes fp8` measures the scales on an exact fp32 engine, whose C layer stack takes
    prefill chunks over its fp32 cache and so would skip the attention layers that note their
    largest keys and values: the calibration runs them one by one, then gives the stack back."""
    from tandem.bench.perplexity import measured_fp8_scales

    with LLM(exact=True, kv_cache_memory="32MiB") as llm:
        model = llm.engine.runner.model
        stack = model.decode_stack
        rounding = measured_fp8_scales(llm.engine, [])
        assert model.decode_stack is stack
    assert len(rounding.scales) == 30 and len(set(rounding.scales)) > 1
    assert all(k < 1 and v < 1 for k, v in rounding.scales)
