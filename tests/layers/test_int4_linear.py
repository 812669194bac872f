"""W4A16 checkpoints: every decoder linear kept in 4 bits, as compressed-tensors stores it.

A tiny Qwen2 whose projections are INT4 (tests/support/w4a16.py) loads with no dense copy of
them, the levels and bf16 scales bit for bit the checkpoint's; its logits follow transformers
on the dequantized weights through the paged path; the engine's greedy tokens equal
transformers' on one rank, split over two (tensor and pipeline parallelism), with prefix hits
and chunked prefill. Kimi K2.5 with its shared experts and dense MLP in INT4 as well runs the
same. What tandem does not compute in 4 bits is refused by name.
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
from tandem.layers.int4_experts import unpack_int32_levels
from tandem.layers.int4_linear import Int4Linear, attach_int4_linear_kernel
from tandem.loader.model_loader import build_model, load_weights, read_model_config
from tests.models.test_parity import mixed_schedule_logits
from tests.support.greedy_parity import engine_greedy, reference_greedy
from tests.support.kimi_k25 import save_tiny_kimi_k25
from tests.support.w4a16 import VOCAB, save_tiny_w4a16_qwen2

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("w4a16-qwen2")
    return directory, save_tiny_w4a16_qwen2(directory)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Q4Kernel:
    return Q4Kernel.build(tmp_path_factory.mktemp("kernels"))


def _loaded(directory: Path, kernel: Q4Kernel | None) -> torch.nn.Module:
    model = build_model(read_model_config(directory), TorchAttentionBackend(), 256, torch.float32)
    load_weights(model, directory)
    assert attach_int4_linear_kernel(model, kernel) == 2 * 4  # qkv, o, gate/up, down per layer
    return model


def test_the_linears_stay_packed_and_equal_the_checkpoint(qwen2: tuple[Path, torch.nn.Module],
                                                          kernel: Q4Kernel) -> None:
    from safetensors import safe_open

    directory, reference = qwen2
    model = _loaded(directory, kernel)
    attention = model.model.layers[1].self_attn
    assert isinstance(attention.qkv_proj.int4, Int4Linear) and attention.qkv_proj.weight.numel() == 0
    assert not any(p.numel() > VOCAB * 128 for n, p in model.named_parameters() if "layers" in n)
    with safe_open(str(directory / "model.safetensors"), "pt") as file:
        packed = file.get_tensor("model.layers.1.self_attn.k_proj.weight_packed")
        scale = file.get_tensor("model.layers.1.self_attn.k_proj.weight_scale")
    expected = (unpack_int32_levels(packed).float() - 8) * scale.float().repeat_interleave(32, dim=1)
    q_rows = reference.model.layers[1].self_attn.q_proj.weight.shape[0]
    merged = attention.qkv_proj.int4.dequantize()
    assert torch.equal(merged[q_rows: q_rows + expected.shape[0]], expected)
    assert torch.equal(expected, reference.model.layers[1].self_attn.k_proj.weight)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["c-kernel", "torch-fallback"])
def test_logits_follow_transformers_on_the_dequantized_weights(qwen2: tuple[Path, torch.nn.Module],
                                                               kernel: Q4Kernel, use_kernel: bool) -> None:
    directory, reference = qwen2
    model = _loaded(directory, kernel if use_kernel else None)
    for got, expected in mixed_schedule_logits(model, reference, VOCAB):
        # the C kernel rounds activations to 16 bits per group of 32 (kernels/q4_gemm.py)
        tolerance = 1e-3 if use_kernel else 1e-4
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    first = [[rng.randrange(3, VOCAB) for _ in range(length)] for length in (6, 21, 37, 11)]
    return first + [p[: len(p) // 2] + [5, 6, 7] for p in first]  # prefix-cache hits


def _reference_greedy(reference: torch.nn.Module) -> list[list[int]]:
    """transformers' greedy continuations, with no near-tie (a top-two gap under 2e-3, twice the
    kernel's logit tolerance) the engine's activation rounding could flip."""
    return reference_greedy(reference, _prompts(), MAX_TOKENS, min_gap=2e-3)


def _engine_greedy(directory: Path, **mode: int) -> list[list[int]]:
    return engine_greedy(directory, _prompts(), first=4, max_tokens=MAX_TOKENS, min_cached=4 * 2, **mode)


@pytest.mark.parametrize("mode", [{}, {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp1", "tp2", "pp2"])
def test_the_engine_s_greedy_tokens_equal_transformers(mode: dict, qwen2: tuple[Path, torch.nn.Module]) -> None:
    directory, reference = qwen2
    assert _engine_greedy(directory, **mode) == _reference_greedy(reference)


def test_kimi_k25_with_int4_shared_experts_and_dense_mlp(tmp_path: Path) -> None:
    reference = save_tiny_kimi_k25(tmp_path, int4_mlps=True)
    config = read_model_config(tmp_path)
    assert config.int4_experts and config.int4_linear("model.layers.0.mlp.gate_proj")
    assert config.int4_linear("model.layers.1.mlp.shared_experts.down_proj")
    assert not config.int4_linear("model.layers.1.self_attn.kv_b_proj")
    assert _engine_greedy(tmp_path, tensor_parallel_size=2) == _reference_greedy(reference)


def _refused(hf: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(hf)


def test_what_tandem_does_not_compute_in_4_bits_is_refused_by_name(qwen2: tuple[Path, torch.nn.Module]) -> None:
    directory, _ = qwen2
    hf = json.loads((directory / "config.json").read_text())
    hf["quantization_config"]["ignore"] = []
    _refused(hf, "lm_head")
    hf["quantization_config"]["ignore"] = ["lm_head", "re:.*k_proj"]
    _refused(hf, "q_proj, model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj but not all")
    kimi = directory / "kimi"
    kimi.mkdir(exist_ok=True)
    save_tiny_kimi_k25(kimi, with_tokenizer=False)
    hf = json.loads((kimi / "config.json").read_text())
    hf["text_config"]["quantization_config"]["ignore"] = ["lm_head"]
    _refused(hf, "self_attn.q_a_proj")
