"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before RoPE (set from the config)."""

from tandem.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
