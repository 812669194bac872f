"""Which layers of a mixture-of-experts model route to experts, and how many experts there are.

One reading of the expert fields of an HF `config.json`, shared by the engine's `MoeConfig`
(tandem/config.py) and the memory plan's `MoEShape` (shape.py), so a config one serves the
other plans. The fields differ by family and by transformers version: hub configs say
`num_experts` (Qwen3-MoE) or `num_local_experts` (Mixtral, Llama 4), and transformers v5 writes
`num_local_experts` for Qwen3-MoE too; DeepSeek-V3 and Kimi-K2 say `n_routed_experts`.

Imports nothing from tandem: `tandem.config` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ExpertLayout:
    """The routed experts of a config: their count, how many a token takes, their width, and
    per decoder layer whether it is a MoE layer (True) or has the dense MLP (False)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    moe_layers: tuple[bool, ...]


def expert_count(hf: dict[str, Any]) -> int | None:
    """The routed experts' count, `num_experts` or `num_local_experts` (DeepSeek's
    `n_routed_experts` is read by its own family); None if the config has neither."""
    for key in ("num_experts", "num_local_experts"):
        value = hf.get(key)
        if value is not None:
            return int(value)
    return None


def expert_layout(arch: str, hf: dict[str, Any]) -> ExpertLayout | None:
    """The expert layout of `hf` (a decoder's fields: Llama 4's `text_config`) for `arch`; None
    for a dense architecture. A KeyError names a field the family needs and the config lacks."""
    layers = int(hf["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        return ExpertLayout(_required_count(hf, "num_local_experts"), int(hf["num_experts_per_tok"]),
                            int(hf["intermediate_size"]), (True,) * layers)
    if arch == "Qwen3MoeForCausalLM":
        experts = _required_count(hf, "num_experts")
        step = int(hf.get("decoder_sparse_step", 1))
        dense = set(hf.get("mlp_only_layers") or [])
        return ExpertLayout(experts, int(hf["num_experts_per_tok"]), int(hf["moe_intermediate_size"]),
                            tuple(i not in dense and experts > 0 and (i + 1) % step == 0
                                  for i in range(layers)))
    if arch == "DeepseekV3ForCausalLM":  # Kimi-K2 too
        experts = int(hf.get("n_routed_experts") or 0)
        dense = int(hf.get("first_k_dense_replace", 0))
        every = int(hf.get("moe_layer_freq", 1))
        return ExpertLayout(experts, int(hf["num_experts_per_tok"]), int(hf["moe_intermediate_size"]),
                            tuple(experts > 0 and i >= dense and i % every == 0 for i in range(layers)))
    if arch == "Llama4ForConditionalGeneration":  # the text_config; HF: range(step - 1, layers, step)
        step = int(hf.get("interleave_moe_layer_step", 1))
        return ExpertLayout(_required_count(hf, "num_local_experts"), int(hf["num_experts_per_tok"]),
                            int(hf["intermediate_size"]),
                            tuple(i >= step - 1 and (i - (step - 1)) % step == 0 for i in range(layers)))
    return None


def _required_count(hf: dict[str, Any], usual: str) -> int:
    count = expert_count(hf)
    if count is None:
        raise KeyError(usual)
    return count
