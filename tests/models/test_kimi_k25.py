"""Kimi K2.5 as it ships, at toy sizes: the multimodal wrapper's text backbone with INT4 experts.

A tiny checkpoint in K2.5's layout (tests/support/kimi_k25.py: nested text_config, tensors under
`language_model.`, a vision tower, compressed-tensors INT4 routed experts) is loaded with its
experts kept packed and run by the 4-bit kernel; its logits follow transformers' DeepseekV3 on
the dequantized weights through the paged path (chunked prefill, decode mixed in), and the
engine's greedy tokens equal transformers' greedy generation, on one rank and split over two
(tensor, expert and pipeline parallelism), with prefix-cache hits and chunked prefill.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tandem.config import ModelConfig
from tandem.kernels.q4_gemm import Q4Kernel
from tandem.kernels.torch_attention import TorchAttentionBackend
from tandem.layers.int4_experts import Int4Experts, attach_int4_expert_kernel, unpack_int32_levels
from tandem.layers.moe import FusedMoE
from tandem.loader.model_loader import build_model, load_weights, read_model_config
from tests.models.test_parity import mixed_schedule_logits
from tests.support.greedy_parity import engine_greedy, reference_greedy
from tests.support.kimi_k25 import VOCAB, save_tiny_kimi_k25

MODES = {
    "tp1": {},
    "tp2": dict(tensor_parallel_size=2),
    "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "pp2": dict(pipeline_parallel_size=2),
}
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("kimi-k25")
    return directory, save_tiny_kimi_k25(directory)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Q4Kernel:
    return Q4Kernel.build(tmp_path_factory.mktemp("kernels"))


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    first = [[rng.randrange(3, VOCAB) for _ in range(length)] for length in (5, 23, 40, 9, 17)]
    # the same prefixes again with new endings: prefix-cache hits
    return first + [p[: len(p) // 2] + [7, 8, 9] for p in first]


def test_the_wrapper_config_is_read_as_its_text_backbone(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    directory, _ = checkpoint
    config = read_model_config(directory)
    assert config.architecture == "KimiK25ForConditionalGeneration"
    assert config.mla is not None and config.moe is not None and config.moe.moe_layers == (False, True, True)
    assert config.int4_experts and config.weight_prefix == "language_model." and config.has_vision_tower
    assert config.eos_token_ids == (2,) and config.vocab_size == VOCAB


def test_a_scheme_tandem_cannot_compute_is_refused_by_name(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    directory, _ = checkpoint
    hf = json.loads((directory / "config.json").read_text())
    hf["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    with pytest.raises(ValueError, match="group_size=128"):
        ModelConfig.from_hf(hf)
    hf = json.loads((directory / "config.json").read_text())
    hf["text_config"]["quantization_config"]["ignore"] = ["lm_head", "re:.*shared_experts.*"]
    with pytest.raises(ValueError, match="self_attn"):  # attention would be INT4 too
        ModelConfig.from_hf(hf)


def _loaded(directory: Path, kernel: Q4Kernel | None) -> torch.nn.Module:
    config = read_model_config(directory)
    model = build_model(config, TorchAttentionBackend(), 256, torch.float32)
    load_weights(model, directory)
    assert attach_int4_expert_kernel(model, kernel) == 2
    return model


def test_the_experts_stay_packed_and_equal_the_checkpoint(checkpoint: tuple[Path, torch.nn.Module],
                                                         kernel: Q4Kernel) -> None:
    from safetensors import safe_open

    directory, reference = checkpoint
    model = _loaded(directory, kernel)
    moe = model.model.layers[1].mlp
    assert isinstance(moe, FusedMoE) and isinstance(moe.int4, Int4Experts)
    assert not hasattr(moe, "w13")  # no dense copy of the experts anywhere
    assert not any(p.dtype.is_floating_point and p.dim() == 3 for p in model.parameters())
    with safe_open(str(directory / "model.safetensors"), "pt") as file:
        packed = file.get_tensor("language_model.model.layers.1.mlp.experts.3.up_proj.weight_packed")
        scale = file.get_tensor("language_model.model.layers.1.mlp.experts.3.up_proj.weight_scale")
    # the levels and bf16 scales are the checkpoint's, bit for bit
    levels = unpack_int32_levels(packed).float() - 8
    expected = levels * scale.float().repeat_interleave(32, dim=1)
    gate_up, _ = moe.int4.dequantized(3)
    assert torch.equal(gate_up[moe.intermediate :], expected)
    fused = reference.model.layers[1].mlp.experts.gate_up_proj.data[3]
    assert torch.equal(gate_up, fused if fused.shape == gate_up.shape else fused.T)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["c-kernel", "torch-fallback"])
def test_logits_follow_transformers_on_the_dequantized_weights(checkpoint: tuple[Path, torch.nn.Module],
                                                               kernel: Q4Kernel, use_kernel: bool) -> None:
    directory, reference = checkpoint
    model = _loaded(directory, kernel if use_kernel else None)
    for got, expected in mixed_schedule_logits(model, reference, VOCAB):
        # the C kernel rounds activations to 16 bits per group of 32 (kernels/q4_gemm.py)
        tolerance = 5e-4 if use_kernel else 1e-4
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.fixture(scope="module")
def transformers_greedy(checkpoint: tuple[Path, torch.nn.Module]) -> list[list[int]]:
    """transformers' greedy continuations, none of its choices a near-tie (a top-two logit gap
    under 1e-3, twice the logit tolerance above; 1.3e-4 measured) that the kernel's activation
    rounding could flip: the comparison below is then exact, not lucky."""
    _, reference = checkpoint
    return reference_greedy(reference, _prompts(), MAX_TOKENS, min_gap=1e-3)


@pytest.mark.parametrize("mode", list(MODES))
def test_the_engine_s_greedy_tokens_equal_transformers(mode: str, checkpoint: tuple[Path, torch.nn.Module],
                                                      transformers_greedy: list[list[int]]) -> None:
    directory, _ = checkpoint
    tokens = engine_greedy(directory, _prompts(), first=5, max_tokens=MAX_TOKENS, min_cached=4 * 4, **MODES[mode])
    assert tokens == transformers_greedy
