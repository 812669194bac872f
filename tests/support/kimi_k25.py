"""A tiny Kimi-K2.5-shaped checkpoint: the published layout at toy sizes.

`KimiK25ForConditionalGeneration` config with the DeepSeek-V3 text model under `text_config`
(latent attention with low-rank queries and interleaved YaRN rotary, a dense first layer, 8
routed experts in 4 groups of which 2 are eligible, 2 per token, a shared expert), its
tensors under `language_model.`, a stand-in vision tower and projector, and the routed
experts in compressed-tensors pack-quantized INT4 (symmetric, group 32, bf16 scales) written
with the `compressed-tensors` package's own packer, the quantization_config with its
`QuantizationConfig` schema and the ignore list K2.5 ships.

The reference is transformers' DeepseekV3ForCausalLM holding the dequantized experts (level
times scale, exactly), i.e. the function the checkpoint stands for.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import load_file, save_file

VOCAB = 96
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_group=4, topk_group=2,
            num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1, moe_intermediate_size=128,
            routed_scaling_factor=2.5, rope_interleave=True, tie_word_embeddings=False, norm_topk_prob=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 64})
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
GROUP = 32


def quantization_config(ignore: list[str] = IGNORE) -> dict:
    """K2.5's quantization_config, built and dumped by the package's own schema."""
    config = QuantizationConfig.model_validate({
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
            "dynamic": False, "observer": "minmax"}}},
        "format": "pack-quantized", "ignore": ignore, "quantization_status": "compressed",
    })
    return config.model_dump(mode="json")


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed int32 [out, in / 8], bf16 scales [out, in / 32], the dequantized fp32 matrix):
    symmetric round-to-nearest per group of 32, levels -8..7."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // GROUP, GROUP)
    scale = (groups.abs().amax(-1, keepdim=True) / 7.5).clamp_min(1e-8).to(torch.bfloat16)
    q = (groups / scale.float()).round().clamp(-8, 7).to(torch.int8)
    dense = (q.float() * scale.float()).reshape(out_features, in_features)
    packed = pack_to_int32(q.reshape(out_features, in_features), 4)
    return packed, scale.squeeze(-1).contiguous(), dense


def save_tiny_kimi_k25(directory: Path, with_tokenizer: bool = True, seed: int = 0,
                       int4_mlps: bool = False) -> torch.nn.Module:
    """Write the checkpoint to `directory`; return the transformers reference (eval, fp32).
    `int4_mlps`: the shared experts and the dense layer's MLP in INT4 too (a W4A16 recipe that
    ignores only attention and the head)."""
    ignore = ["lm_head", "re:.*self_attn.*"] if int4_mlps else IGNORE
    torch.manual_seed(seed)
    # INT4 MLPs: the dense layer's intermediate on whole 64-input blocks of the 4-bit kernel
    config = transformers.DeepseekV3Config(**(TEXT | {"intermediate_size": 128} if int4_mlps else TEXT))
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.08 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.5 * torch.randn_like(buffer))
    dense_dir = directory / "dense"
    model.save_pretrained(dense_dir)
    tensors = {}
    for file in sorted(dense_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    state = {}
    for name, tensor in tensors.items():
        mlp_linear = int4_mlps and ".mlp." in name and name.endswith("_proj.weight")
        if (".mlp.experts." in name and name.endswith(".weight")) or mlp_linear:
            packed, scale, dense = quantize_int4(tensor)
            stem = "language_model." + name.removesuffix(".weight")
            state[f"{stem}.weight_packed"] = packed
            state[f"{stem}.weight_scale"] = scale
            state[f"{stem}.weight_shape"] = torch.tensor(list(tensor.shape), dtype=torch.int32)
            tensors[name] = dense  # what the reference computes with
        else:
            state["language_model." + name] = tensor.contiguous()
    # the vision tower and projector, which a text-only load skips
    state["vision_tower.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 2)
    state["mm_projector.proj.0.weight"] = torch.randn(64, 64)
    save_file(state, str(directory / "model.safetensors"))
    shutil.rmtree(dense_dir)
    with torch.no_grad():
        reference_state = model.state_dict()
        for name, tensor in tensors.items():
            if ".mlp.experts." in name or (int4_mlps and ".mlp." in name and name.endswith("_proj.weight")):
                _assign_expert(model, reference_state, name, tensor)
    text = config.to_dict()
    text["architectures"] = ["DeepseekV3ForCausalLM"]
    text["quantization_config"] = quantization_config(ignore)
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "media_placeholder_token_id": 95,
               "quantization_config": quantization_config(ignore), "text_config": text,
               "tie_word_embeddings": False,
               "vision_config": {"vt_hidden_size": 16, "vt_num_hidden_layers": 1, "patch_size": 2,
                                 "mm_hidden_size": 16, "text_hidden_size": 64}}
    (directory / "config.json").write_text(json.dumps(wrapper, indent=2))
    if with_tokenizer:
        from tandem.loader.resolve import resolve_model

        source = resolve_model("smollm2-135m").hf_dir
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / file, directory / file)
    return model


def _assign_expert(model: torch.nn.Module, state: dict[str, torch.Tensor], name: str, dense: torch.Tensor) -> None:
    """Put one expert's dequantized matrix into the reference, whatever layout transformers
    keeps its experts in (per-expert linears, or fused [E, ...] stacks it converts on save)."""
    if name in state:
        state[name].copy_(dense)
        return
    # transformers >= 5 fuses experts: mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]
    prefix, _, rest = name.partition(".mlp.experts.")
    expert, projection, _ = rest.split(".")
    experts = model.get_submodule(f"{prefix}.mlp.experts")
    e = int(expert)
    if projection == "down_proj":
        experts.down_proj.data[e].copy_(_oriented(experts.down_proj.data[e], dense))
    else:
        inter = dense.shape[0]
        fused = experts.gate_up_proj.data[e]
        if fused.shape[0] == 2 * inter:
            rows = fused.narrow(0, 0 if projection == "gate_proj" else inter, inter)
            rows.copy_(dense)
        else:  # [H, 2I]
            cols = fused.narrow(1, 0 if projection == "gate_proj" else inter, inter)
            cols.copy_(dense.T)


def _oriented(target: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    return dense if target.shape == dense.shape else dense.T
