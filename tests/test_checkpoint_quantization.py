"""Reading a checkpoint's compressed-tensors scheme without torch, as the package reads it."""

from __future__ import annotations

import pytest
from compressed_tensors.utils.match import match_name

from tandem.checkpoint_quantization import WeightQuantization
from tests.support.kimi_k25 import IGNORE, quantization_config

K25_NAMES = [
    "language_model.model.layers.1.mlp.experts.17.gate_proj", "language_model.model.layers.60.mlp.experts.383.down_proj",
    "language_model.model.layers.0.mlp.gate_proj", "language_model.model.layers.3.mlp.shared_experts.up_proj",
    "language_model.model.layers.3.self_attn.q_a_proj", "language_model.model.layers.3.self_attn.kv_b_proj",
    "lm_head", "model.layers.2.mlp.experts.0.up_proj", "model.layers.2.mlp.down_proj",
]


def test_the_ignore_rules_match_as_compressed_tensors_matches_them() -> None:
    scheme = WeightQuantization.from_hf({"quantization_config": quantization_config()})
    assert scheme is not None and scheme.ignore == tuple(IGNORE) and scheme.group_size == 32
    for name in K25_NAMES:
        ignored = any(match_name(name, rule) for rule in IGNORE)
        assert scheme.quantizes(name) == (not ignored), name
    assert scheme.quantizes("language_model.model.layers.1.mlp.experts.17.gate_proj")
    assert not scheme.quantizes("language_model.model.layers.1.mlp.shared_experts.gate_proj")


@pytest.mark.parametrize("field, value, message", [
    ("num_bits", 8, "num_bits=8"), ("symmetric", False, "symmetric=False"), ("group_size", 128, "group_size=128"),
    ("type", "float", "type='float'"), ("strategy", "channel", "strategy='channel'"),
])
def test_schemes_tandem_does_not_compute_are_refused_by_field(field: str, value: object, message: str) -> None:
    config = quantization_config()
    config["config_groups"]["group_0"]["weights"][field] = value
    with pytest.raises(ValueError, match=message):
        WeightQuantization.from_hf({"quantization_config": config})


def test_other_quantization_and_none_are_not_this_scheme() -> None:
    assert WeightQuantization.from_hf({}) is None
    assert WeightQuantization.from_hf({"quantization_config": {"quant_method": "fp8"}}) is None
    config = quantization_config()
    config["format"] = "float-quantized"
    with pytest.raises(ValueError, match="pack-quantized"):
        WeightQuantization.from_hf({"quantization_config": config})
