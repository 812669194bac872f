"""tandem's fp32 GEMV against the float64 product of the same matrix."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tandem.kernels.dense_gemv import SOURCE, DenseGemvKernel, DenseRows


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> DenseGemvKernel:
    return DenseGemvKernel.build(tmp_path_factory.mktemp("cache"))


def _reference(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None):
    out = x.double() @ weight.double().T  # a bf16 weight's value exactly
    if bias is not None:
        out = out + bias.double()
    out = out.float()
    return out if residual is None else residual + out


# K: whole unrolled blocks (576, 1536), a single-vector tail (80 = 64 + 16) and a scalar tail
# (83); N: fewer rows than threads, and odd counts the threads split unevenly.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-weights"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("shape", [(1, 576), (7, 83), (97, 80), (960, 576), (576, 1536)])
def test_gemv_is_the_fp32_product(kernel: DenseGemvKernel, rows: int, shape: tuple[int, int],
                                  dtype: torch.dtype) -> None:
    """bf16 weights are widened exactly: the product is that of their fp32 values."""
    generator = torch.Generator().manual_seed(rows * 100 + shape[1])
    weight = (torch.randn(shape, generator=generator) / 8).to(dtype)
    x = torch.randn(rows, shape[1], generator=generator)
    got = kernel.gemv(weight, x)
    assert got.shape == (rows, shape[0]) and got.dtype == torch.float32
    # fp32 products and sums: a few ulps of the largest partial sums, nowhere near an
    # int8 or half-precision error (~1e-3 relative)
    torch.testing.assert_close(got, _reference(weight, x, None, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 6])
def test_bias_and_residual_are_added_as_linear_then_residual(kernel: DenseGemvKernel, rows: int) -> None:
    torch.manual_seed(rows)
    weight, bias = torch.randn(130, 192), torch.randn(130)
    x, residual = torch.randn(rows, 192), torch.randn(rows, 130)
    torch.testing.assert_close(kernel.gemv(weight, x, bias, residual), _reference(weight, x, bias, residual),
                               rtol=1e-5, atol=1e-5)
    # through the layer's wrapper (fast-math may add bias and residual in either order)
    rows_matrix = DenseRows(weight, bias, kernel)
    torch.testing.assert_close(rows_matrix.matmul(x, residual=residual), residual + rows_matrix.matmul(x),
                               rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(rows_matrix.matmul(x, with_bias=False), _reference(weight, x, None, None),
                               rtol=1e-5, atol=1e-5)


def test_leading_dimensions_are_kept(kernel: DenseGemvKernel) -> None:
    torch.manual_seed(0)
    weight = torch.randn(40, 64)
    x = torch.randn(2, 3, 64)
    got = DenseRows(weight, None, kernel).matmul(x)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got, x @ weight.T, rtol=1e-5, atol=1e-5)


def test_the_isa_is_named(kernel: DenseGemvKernel) -> None:
    assert kernel.isa in ("avx512", "avx2", "portable C")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize("march, isa", [("x86-64", "portable C"), ("haswell", "avx2")])
def test_every_instruction_set_path_computes_the_same(tmp_path: Path, march: str, isa: str) -> None:
    """The machines this runs on differ (AVX2-only EPYCs, AVX-512 Xeons): the paths this CPU
    does not pick by itself are built for an older target and checked against the product."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    library = tmp_path / f"gemv-{march}.so"
    subprocess.run([compiler, "-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", "-std=c11", str(SOURCE),
                    "-o", str(library), "-lm"], check=True, capture_output=True)
    other = DenseGemvKernel(library)
    assert other.isa == isa
    torch.manual_seed(2)
    weight, x = torch.randn(67, 83) / 8, torch.randn(3, 83)  # tails on every path
    torch.testing.assert_close(other.gemv(weight, x), _reference(weight, x, None, None), rtol=1e-5, atol=1e-5)
    half = weight.bfloat16()
    torch.testing.assert_close(other.gemv(half, x), _reference(half, x, None, None), rtol=1e-5, atol=1e-5)
    assert torch.equal(other.gemv_bf16(half, x.bfloat16()), other.gemv(half, x.bfloat16().float()).bfloat16())


def test_a_bf16_layer_s_rows_take_bf16_activations_and_round_once(kernel: DenseGemvKernel) -> None:
    """The bf16 model's small steps (CPUs without a bf16 GEMM): bf16 in and out, fp32 inside."""
    torch.manual_seed(3)
    weight, bias = torch.randn(72, 96).bfloat16(), torch.randn(72)
    x, residual = torch.randn(5, 96).bfloat16(), torch.randn(5, 72).bfloat16()
    matrix = DenseRows(weight, bias, kernel)
    got = matrix.matmul(x, residual=residual)
    assert got.dtype == torch.bfloat16
    expected = _reference(weight, x.float(), bias, residual.float()).bfloat16()
    assert (got.float() - expected.float()).abs().max() <= expected.float().abs().max() * 2**-8


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_the_all_bf16_entry_rounds_the_fp32_kernel_s_result_once(kernel: DenseGemvKernel, rows: int) -> None:
    """`--decode-weights bfloat16` in a bf16 model: bf16 x, residual and out, one C call, the
    same bits as widening x and the residual, the fp32-activation kernel, then rounding (so
    the decode stack and the layer path agree bit for bit)."""
    torch.manual_seed(rows + 10)
    weight, bias = torch.randn(130, 200).bfloat16(), torch.randn(130)
    x, residual = torch.randn(rows, 200).bfloat16(), torch.randn(rows, 130).bfloat16()
    for b, r in ((None, None), (bias, None), (bias, residual)):
        got = kernel.gemv_bf16(weight, x, b, r)
        widened = kernel.gemv(weight, x.float(), b, None if r is None else r.float())
        assert got.dtype == torch.bfloat16 and torch.equal(got, widened.bfloat16())
    # in place on the residual, as the decode stack calls it
    inplace = residual.clone()
    kernel._bf16_gemv(weight.data_ptr(), None, x.data_ptr(), inplace.data_ptr(), inplace.data_ptr(), rows, 130, 200,
                      torch.get_num_threads())
    assert torch.equal(inplace, kernel.gemv_bf16(weight, x, None, residual))
