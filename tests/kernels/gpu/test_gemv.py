"""The one-row GEMV (tandem/kernels/gpu/gemv.py) against torch in fp32, in Triton's CPU
interpreter: row blocks and K steps that do and do not divide the matrix, the bias, the
residual and the gated MLP's silu-and-mul read from the gate/up row; and the linear layers
taking it for one-row steps only, with the device's table as their guide."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.gpu.gemv import (
    CANDIDATES,
    GemvConfig,
    GpuGemv,
    gemv,
    load_table,
    table_entry,
    table_path,
    write_table,
)
from tandem.layers.linear import GateUpLinear, Linear, RowParallelLinear, attach_gpu_gemv

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
               silu_mul: bool) -> torch.Tensor:
    if silu_mul:  # tandem/kernels/gpu/silu_mul.py's two roundings
        gate, up = x.float().chunk(2, dim=-1)
        x = (F.silu(gate).to(x.dtype).float() * up).to(x.dtype)
    out = x.float() @ weight.float().T
    out = out if bias is None else out + bias.float()
    out = out if residual is None else out + residual.float()
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "k", "config"), [
    (64, 128, GemvConfig(16, 32)),  # both divide
    (40, 96, GemvConfig(16, 32)),  # the last row block partial
    (48, 100, GemvConfig(8, 64)),  # the last K step partial
    (7, 70, GemvConfig(4, 1024, 8)),  # one K step wider than the row
])
@pytest.mark.parametrize("form", ["plain", "bias", "residual", "silu_mul", "all"])
def test_gemv_matches_torch(dtype: torch.dtype, n: int, k: int, config: GemvConfig, form: str) -> None:
    generator = torch.Generator().manual_seed(n * k)
    silu_mul = form in ("silu_mul", "all")
    x = torch.randn(1, 2 * k if silu_mul else k, generator=generator).to(dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype) if form in ("bias", "all") else None
    residual = torch.randn(1, n, generator=generator).to(dtype) if form in ("residual", "all") else None
    got = gemv(x, weight, config, bias, residual, silu_mul)
    assert got.shape == (1, n) and got.dtype == dtype
    torch.testing.assert_close(got, _reference(x, weight, bias, residual, silu_mul),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_the_candidates_are_launchable_block_shapes() -> None:
    for config in CANDIDATES:
        assert config.block_n & (config.block_n - 1) == 0 and config.block_k & (config.block_k - 1) == 0
        assert config.block_n * config.block_k // (32 * config.num_warps) <= 128  # fp32 accumulators a thread


def test_a_table_round_trips_and_answers_only_its_dtype(tmp_path: Path) -> None:
    path = table_path("NVIDIA H200 (x)", tmp_path)
    assert path.name == "NVIDIA_H200__x_.json"
    write_table(path, "NVIDIA H200 (x)", torch.bfloat16, {"6144x4096": table_entry(GemvConfig(8, 512), 12.0, 15.0)})
    assert json.loads(path.read_text())["shapes"]["6144x4096"]["cublas_us"] == 15.0
    assert load_table("NVIDIA H200 (x)", torch.bfloat16, tmp_path) == {(6144, 4096): GemvConfig(8, 512)}
    assert load_table("NVIDIA H200 (x)", torch.float16, tmp_path) == {}
    assert load_table("another GPU", torch.bfloat16, tmp_path) == {}


class _Counting(GpuGemv):
    def __init__(self, config: GemvConfig) -> None:
        super().__init__(config)
        self.calls = 0

    def matmul(self, *args, **kwargs) -> torch.Tensor:
        self.calls += 1
        return super().matmul(*args, **kwargs)


def test_linear_layers_take_it_for_one_row_steps_of_their_shape() -> None:
    torch.manual_seed(0)
    qkv, o = Linear(48, 80, bias=True), Linear(32, 48)
    for layer in (qkv, o):
        torch.nn.init.normal_(layer.weight, std=0.1)
    kernel = _Counting(GemvConfig(16, 32))
    model = torch.nn.ModuleList([qkv, o])
    assert attach_gpu_gemv(model, {(80, 48): kernel}) == 1
    assert qkv.gpu_gemv is kernel and o.gpu_gemv is None
    row, rows = torch.randn(1, 48), torch.randn(3, 48)
    torch.testing.assert_close(qkv(row), F.linear(row, qkv.weight, qkv.bias), atol=1e-5, rtol=1e-5)
    assert kernel.calls == 1
    qkv(rows)  # more rows than one: cuBLAS's (here torch's)
    assert kernel.calls == 1
    residual = torch.randn(1, 80)
    torch.testing.assert_close(qkv(row, residual), residual + F.linear(row, qkv.weight, qkv.bias), atol=1e-5,
                               rtol=1e-5)
    assert kernel.calls == 2


def test_the_gated_mlp_reads_the_gate_up_row_into_the_down_projection() -> None:
    torch.manual_seed(1)
    gate_up, down = GateUpLinear(48, 64), RowParallelLinear(64, 48)
    for layer in (gate_up, down):
        torch.nn.init.normal_(layer.weight, std=0.1)
    x, residual = torch.randn(1, 48), torch.randn(1, 48)
    expected = down(gate_up(x), residual)
    kernels = {(128, 48): _Counting(GemvConfig(16, 32)), (48, 64): _Counting(GemvConfig(8, 64))}
    assert attach_gpu_gemv(torch.nn.ModuleList([gate_up, down]), kernels) == 2
    got = gate_up.gated_down(down, x, residual)
    assert got is not None and kernels[(128, 48)].calls == 1 and kernels[(48, 64)].calls == 1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert gate_up.gated_down(down, torch.randn(2, 48), torch.randn(2, 48)) is None  # two rows: one by one


def test_the_bench_checks_every_candidate_and_picks_a_winner_only_by_the_margin() -> None:
    """`tandem bench gpu --gemv`'s measurement of one case, on the CPU (fp16, interpreted):
    each candidate's output against cuBLAS's way (here torch's), then the table's choice."""
    from tandem.bench.gpu_gemv import WIN_MARGIN, GemvCase, gemv_cases, measure_case, winner

    case = GemvCase("down_proj", 24, 40, residual=True, silu_mul=True)
    entry = measure_case(torch, case, lambda launches: 1e-5, copy_gb_s=1000.0, device="cpu")
    assert entry["copies"] == 16  # a small matrix: as many copies as a timing takes
    assert len(entry["candidates"]) == len(CANDIDATES)
    assert max(c["max_rel_error"] for c in entry["candidates"]) < 2e-3
    assert entry["bound_us"] == pytest.approx(24 * 40 * 2 / 1e12 * 1e6)
    assert winner(entry) is None  # a tie is cuBLAS's
    entry["candidates"][3]["us"] = entry["cublas"]["us"] * WIN_MARGIN
    assert winner(entry) is entry["candidates"][3]
    names = [c.name for c in gemv_cases({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                                         "intermediate_size": 14336, "vocab_size": 128256})]
    assert names == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
