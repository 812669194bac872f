"""A tiny W4A16 checkpoint: every decoder linear in compressed-tensors INT4, the LM head bf16.

llm-compressor's W4A16 recipe at toy sizes, on a Qwen2 (grouped-query attention, q/k/v biases):
`config_groups` targeting `Linear`, group 32, symmetric, ignoring `lm_head`, the tensors
packed by the `compressed-tensors` package's own packer (tests/support/kimi_k25.py
`quantize_int4`). Sizes keep every row-parallel half on whole 64-input blocks of the 4-bit
kernel (o_proj's 128 inputs, down_proj's 256), so tensor parallelism over two ranks splits it.

The reference is transformers' Qwen2ForCausalLM holding the dequantized matrices (level times
scale, exactly): the function the checkpoint stands for.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from tests.support.kimi_k25 import quantization_config, quantize_int4

VOCAB = 96
QWEN2 = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, rope_theta=10000.0)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_tiny_w4a16_qwen2(directory: Path, seed: int = 0) -> torch.nn.Module:
    """Write the checkpoint to `directory`; return the transformers reference (eval, fp32)."""
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(**QWEN2)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.08 * torch.randn_like(param))
    state = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            module, _, field = name.rpartition(".")
            if field == "weight" and module.rpartition(".")[2] in LINEARS:
                packed, scale, dense = quantize_int4(param.data)
                state[f"{module}.weight_packed"] = packed
                state[f"{module}.weight_scale"] = scale
                state[f"{module}.weight_shape"] = torch.tensor(list(param.shape), dtype=torch.int32)
                param.copy_(dense)  # what the reference computes with
            else:
                state[name] = param.data.clone().contiguous()
    save_file(state, str(directory / "model.safetensors"))
    hf = config.to_dict()
    hf["architectures"] = ["Qwen2ForCausalLM"]
    hf["quantization_config"] = quantization_config(["lm_head"])
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    from tandem.loader.resolve import resolve_model

    source = resolve_model("smollm2-135m").hf_dir
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / file, directory / file)
    return model

