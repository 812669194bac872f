"""Key divisors folded into the query/key projections (tandem/models/key_divisors.py): powers of
two from the weights, equal within a rope pair, that scale the query and key rows exactly and
leave the model's outputs bitwise as they were."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from tandem import LLM, SamplingParams
from tandem.config import ModelConfig
from tandem.kernels.torch_attention import TorchAttentionBackend
from tandem.loader.model_loader import build_model, init_dummy_weights
from tandem.models.key_divisors import MAX_EXPONENT, fold_key_divisors, key_divisor_exponents
from tandem.worker import model_builder

HEAD_DIM = 8


def test_a_large_rope_pair_is_divided_and_a_small_one_multiplied() -> None:
    """Per head: the pairs' expected sizes against their median, half the log2, rounded; the
    bias counts, and the exponent is the same for both channels of a pair."""
    rows = torch.ones(2 * HEAD_DIM, 4)
    bias = torch.zeros(2 * HEAD_DIM)
    bias[1] = bias[1 + HEAD_DIM // 2] = 63.0  # head 0, pair 1: size 64 / 2 against a median of 2
    rows[HEAD_DIM + 2] = rows[HEAD_DIM + 2 + HEAD_DIM // 2] = 1 / 64  # head 1, pair 2: 1/64 of the rest
    exponents = key_divisor_exponents(rows, bias, torch.ones(4), HEAD_DIM)
    assert exponents.shape == (2, HEAD_DIM)
    assert torch.equal(exponents[:, : HEAD_DIM // 2], exponents[:, HEAD_DIM // 2 :])
    assert exponents[0].tolist() == [0, 2, 0, 0] * 2  # sqrt(64 / 2) = 2^2.5 -> rounds to 2^2
    assert exponents[1].tolist() == [0, 0, -3, 0] * 2
    bias[1] = bias[1 + HEAD_DIM // 2] = 1e30
    assert key_divisor_exponents(rows, bias, torch.ones(4), HEAD_DIM)[0, 1] == MAX_EXPONENT


def _tiny_qwen2() -> torch.nn.Module:
    config = transformers.Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = build_model(ModelConfig.from_hf(config.to_dict() | {"architectures": ["Qwen2ForCausalLM"]}),
                        TorchAttentionBackend(), 64, torch.float32)
    init_dummy_weights(model, seed=0)
    with torch.no_grad():  # a bias on one key pair of the second layer's first head, as Qwen2.5's
        attention = model.model.layers[1].self_attn
        attention.qkv_proj.bias[attention.q_size + 3] = 40.0
        attention.qkv_proj.bias[attention.q_size + 3 + attention.head_dim // 2] = 40.0
    return model


def test_folding_scales_query_rows_up_and_key_rows_down_by_the_same_power_of_two() -> None:
    model, original = _tiny_qwen2(), _tiny_qwen2()
    digest = fold_key_divisors(model)
    assert digest and digest == fold_key_divisors(_tiny_qwen2())  # a function of the weights
    attention, before = model.model.layers[1].self_attn, original.model.layers[1].self_attn
    q, k, head_dim = attention.q_size, attention.kv_size, attention.head_dim
    group = attention.num_heads // attention.num_kv_heads
    folded, plain = attention.qkv_proj.weight, before.qkv_proj.weight
    key_ratio = (folded[q : q + k] / plain[q : q + k]).reshape(attention.num_kv_heads, head_dim, -1)
    exponents = -torch.log2(key_ratio[..., 0])
    assert torch.equal(exponents, exponents.round())
    assert exponents[0, 3] > 0 and exponents[0, 3] == exponents[0, 3 + head_dim // 2]
    assert torch.equal(key_ratio, key_ratio[..., :1].expand_as(key_ratio))  # one factor a row
    key_scale = torch.exp2(-exponents).reshape(-1)
    query_scale = torch.exp2(exponents).repeat_interleave(group, dim=0).reshape(-1)
    for name in ("weight", "bias"):
        folded, plain = getattr(attention.qkv_proj, name), getattr(before.qkv_proj, name)
        shape = (-1,) + (1,) * (plain.dim() - 1)
        assert torch.equal(folded[:q], plain[:q] * query_scale.view(shape))
        assert torch.equal(folded[q : q + k], plain[q : q + k] * key_scale.view(shape))
        assert torch.equal(folded[q + k :], plain[q + k :])  # values as they were


def test_a_model_with_query_and_key_norms_is_left_as_it_is() -> None:
    """Qwen3 normalizes each head's q and k: a divisor before the norm would be undone."""
    config = transformers.Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64)
    model = build_model(ModelConfig.from_hf(config.to_dict() | {"architectures": ["Qwen3ForCausalLM"]}),
                        TorchAttentionBackend(), 64, torch.float32)
    init_dummy_weights(model, seed=0)
    weight = model.model.layers[0].self_attn.qkv_proj.weight.clone()
    assert fold_key_divisors(model) == ""
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight, weight)


def _greedy_with_logprobs() -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    with LLM(kv_cache_memory="64MiB") as llm:
        outputs = llm.generate(["def fibonacci(n):", "The capital of France is", "List three colors:"], params,
                               use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [[(entry.token_id, entry.logprob) for entry in step] for step in o.outputs[0].logprobs]) for o in outputs]


def test_the_default_model_s_outputs_are_bitwise_those_without_divisors(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """SmolLM2's layers take divisors; an fp32 cache's greedy tokens and logprobs are the same
    numbers as the model's without them."""
    with caplog.at_level(logging.INFO, logger=model_builder.__name__):
        folded = _greedy_with_logprobs()
    assert "key divisors folded" in caplog.text
    monkeypatch.setattr(model_builder, "fold_key_divisors", lambda model: "")
    assert _greedy_with_logprobs() == folded
