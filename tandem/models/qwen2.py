"""Qwen2: the Llama decoder with q/k/v biases (set from the config) and an optional tied head."""

from tandem.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
