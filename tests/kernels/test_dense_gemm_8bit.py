"""8-bit weights for bf16 rows on AMX's tiles (`--quantization w8a16`, csrc/dense_gemm.c kind 3):
each output row of the matrix rounded to int8 with one fp32 scale, the bytes widened to bf16
tiles in L1 on their way to the tile products (amx_gemm.h's WIDENS), the scales applied in the
epilogue. The products are those of the dequantized matrix, summed in fp32 and rounded once,
for every unit shape, the pair-by-pair order below 256 rows and the snake from there."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem.kernels.dense_gemm import SOURCE, DenseGemmKernel
from tandem.platform.cpu_modes import CpuFeatures
from tests.support.kernel_builds import build_for

FEATURES = CpuFeatures.detect()
AMX = FEATURES.amx and FEATURES.avx512_bf16
needs_amx = pytest.mark.skipif(not AMX, reason="8-bit weights are widened on AMX's bf16 tiles only")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> DenseGemmKernel:
    built = DenseGemmKernel.build(tmp_path_factory.mktemp("cache"))
    if built.isa != "amx-bf16":
        pytest.skip("8-bit weights are widened on AMX's bf16 tiles only")
    return built


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _within_a_bf16_step(got: torch.Tensor, want: torch.Tensor, in_features: int) -> bool:
    step = want.abs().clamp_min(1e-3) * 2.0 ** -7
    return bool(((got.double() - want).abs() <= step + 1e-4 * in_features ** 0.5).all())


@needs_amx
def test_each_row_is_rounded_to_int8_with_one_scale(kernel: DenseGemmKernel) -> None:
    """Round to nearest on a grid of the row's largest magnitude / 127: every value within half
    a step of its own, the largest exact, and a row already on such a grid kept exactly."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 96, generator=generator).bfloat16()
    weight[5] = (torch.arange(96) % 255 - 127).bfloat16() * 0.5  # on its own grid: 0.5 x -127..127
    packed = kernel.pack(weight, bits=8)
    assert packed.values.dtype == torch.int8 and packed.values.numel() == 48 * 96 + 48 * 4
    assert packed.rows_dtype == torch.bfloat16
    dequantized = packed.weight()
    scales = weight.float().abs().amax(dim=1, keepdim=True) / 127
    assert ((dequantized - weight.float()).abs() <= scales / 2 + 1e-6).all()
    assert torch.equal(dequantized[5], weight[5].float())
    largest = weight.float().abs().argmax(dim=1)
    torch.testing.assert_close(dequantized.gather(1, largest[:, None]), weight.float().gather(1, largest[:, None]))


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 64, 100, 255, 256, 300])
@pytest.mark.parametrize("in_features, out_features", [(32, 16), (96, 48), (576, 960), (1536, 64), (64, 1536)])
def test_products_are_the_dequantized_matrix_s(kernel, rows, in_features, out_features) -> None:
    """With bias and residual and without, against F.linear over the dequantized matrix in
    fp64: within one bf16 step of the result rounded once. 1-16 rows are one row tile, 17-32
    two; from 256 rows the units go in a snake over the widened panel."""
    generator = torch.Generator().manual_seed(rows * 7 + in_features)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5).bfloat16()
    packed = kernel.pack(weight, bits=8)
    exact = packed.weight().double()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    residual = torch.randn(rows, out_features, generator=generator).bfloat16()
    want = torch.nn.functional.linear(x.double(), exact, bias.double()) + residual.double()
    got = kernel.matmul(x, packed, bias, residual)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert _within_a_bf16_step(got, want, in_features)
    assert _within_a_bf16_step(kernel.matmul(x, packed), x.double() @ exact.t(), in_features)


@needs_amx
@pytest.mark.parametrize("rows", [1, 7, 33, 64, 300])
@pytest.mark.parametrize("in_features, intermediate", [(32, 16), (576, 64), (64, 1536)])
def test_gated_products_are_silu_of_the_dequantized_gate_times_up(kernel, rows, in_features, intermediate) -> None:
    """The gate/up layout in 8 bits: each interleaved row keeps its own scale, and the epilogue
    takes the gate's and the up's before silu(gate) * up."""
    generator = torch.Generator().manual_seed(rows + intermediate)
    weight = (torch.randn(2 * intermediate, in_features, generator=generator) / in_features ** 0.5).bfloat16()
    packed = kernel.pack_gated(weight, bits=8)
    pairs = kernel.pack(weight, bits=8).weight().reshape(2, intermediate // 16, 16, in_features)
    assert torch.equal(packed.weight(), pairs.transpose(0, 1).reshape(2 * intermediate, in_features))
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    gate, up = (x.double() @ kernel.pack(weight, bits=8).weight().double().t()).chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = kernel.silu_mul(x, packed)
    step = want.abs().clamp_min(1e-3) * 2.0 ** -7
    assert got.shape == (rows, intermediate) and ((got.double() - want).abs() <= step + 1e-3).all()


@needs_amx
@pytest.mark.parametrize("rows", [3, 64, 300])
def test_any_thread_count_gives_one_threads_bits(kernel, rows) -> None:
    """A unit's sums do not depend on which thread widened its tiles or multiplied it."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(960, 576, generator=generator).bfloat16()
    x = torch.randn(rows, 576, generator=generator).bfloat16()
    packed = kernel.pack(weight, bits=8)
    with _threads(1):
        want = kernel.matmul(x, packed)
    for threads in (2, 3):
        with _threads(threads):
            assert torch.equal(kernel.matmul(x, packed), want)


def test_where_it_refuses_8_bit_weights(tmp_path: Path) -> None:
    """A K that is no multiple of the tiles' 32, fp32 weights, and any build without AMX's
    tiles (the AVX-512-BF16 one here): `fits` says no and `pack` explains."""
    native = DenseGemmKernel.build(tmp_path / "native")
    builds = [native]
    if FEATURES.avx512_bf16:
        builds.append(DenseGemmKernel(build_for(SOURCE, "cooperlake", tmp_path)))
    for built in builds:
        amx = built.isa == "amx-bf16"
        assert built.fits(torch.zeros(32, 64, dtype=torch.bfloat16), bits=8) == amx
        assert not built.fits(torch.zeros(32, 48, dtype=torch.bfloat16), bits=8)
        assert not built.fits(torch.zeros(32, 64), bits=8)
        with pytest.raises(ValueError, match="8-bit weights need AMX"):
            built.pack(torch.zeros(32, 48, dtype=torch.bfloat16), bits=8)
        if not amx:
            with pytest.raises(ValueError, match="8-bit weights need AMX"):
                built.pack(torch.zeros(32, 64, dtype=torch.bfloat16), bits=8)
