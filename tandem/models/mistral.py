"""Mistral: the Llama decoder (sliding window is handled by capping the context length)."""

from tandem.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
