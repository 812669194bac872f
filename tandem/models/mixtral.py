"""Mixtral: the Mistral decoder with a mixture-of-experts MLP in every layer (8 experts, top 2).

Its checkpoints name the MoE block `block_sparse_moe` and an expert's projections w1 (gate),
w3 (up) and w2 (down).
"""

from tandem.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    moe_module = "block_sparse_moe"
    expert_projections = {"w1": "gate", "w3": "up", "w2": "down"}
