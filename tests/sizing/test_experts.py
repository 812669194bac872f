"""The expert fields of a config.json, read once for the engine and the memory plan.

transformers v5 writes Qwen3-MoE's expert count as `num_local_experts` (the hub's files say
`num_experts`); the engine served such a config while the plan refused it, so both now read it
through `expert_layout`.
"""

from __future__ import annotations

from typing import Any

import pytest

from tandem.config import MoeConfig
from tandem.sizing.devices import parse_devices
from tandem.sizing.examples import load_config
from tandem.sizing.experts import expert_layout
from tandem.sizing.memory import PlanRequest, plan_memory
from tandem.sizing.shape import read_shape
from tandem.sizing.sharding import Parallel


def qwen3_moe(v5: bool) -> dict[str, Any]:
    _, config = load_config("qwen3-235b-a22b")
    if v5:
        config["num_local_experts"] = config.pop("num_experts")
    return config


def test_a_transformers_v5_qwen3_moe_config_plans_like_the_hub_one() -> None:
    request = PlanRequest(parse_devices("8xH200"), Parallel(tp=8))
    hub, v5 = plan_memory(qwen3_moe(False), request), plan_memory(qwen3_moe(True), request)
    assert v5 == hub
    assert read_shape(qwen3_moe(True)).moe.num_experts == 128


@pytest.mark.parametrize("v5", [False, True])
def test_the_engine_and_the_plan_read_the_same_experts(v5: bool) -> None:
    config = qwen3_moe(v5)
    engine = MoeConfig.from_hf("Qwen3MoeForCausalLM", config)
    shape = read_shape(config).moe
    assert engine.num_experts == shape.num_experts == 128
    assert engine.top_k == shape.top_k == 8
    assert {i for i, routed in enumerate(engine.moe_layers) if routed} == set(shape.layers)


@pytest.mark.parametrize(("name", "experts", "moe_layers"), [
    ("deepseek-v3", 256, 58),  # the first 3 of 61 layers are dense
    ("kimi-k2", 384, 60),  # the first of 61
    ("qwen3-235b-a22b", 128, 94),
])
def test_moe_layers_of_the_examples(name: str, experts: int, moe_layers: int) -> None:
    _, config = load_config(name)
    layout = expert_layout(config["architectures"][0], config)
    assert layout.num_experts == experts and sum(layout.moe_layers) == moe_layers


def test_llama4_moe_layers_follow_the_interleave_step() -> None:
    _, config = load_config("llama-4-scout")
    text = {**config["text_config"], "interleave_moe_layer_step": 2}
    layout = expert_layout("Llama4ForConditionalGeneration", text)
    assert [i for i, routed in enumerate(layout.moe_layers) if routed] == list(range(1, 48, 2))


def test_dense_architectures_have_no_experts() -> None:
    _, config = load_config("llama-3.1-70b")
    assert expert_layout("LlamaForCausalLM", config) is None


def test_a_missing_expert_count_names_the_field() -> None:
    with pytest.raises(KeyError, match="num_local_experts"):
        expert_layout("MixtralForCausalLM", {"num_hidden_layers": 2, "num_experts_per_tok": 2,
                                             "intermediate_size": 8})
