"""The C passes around the 8-bit GEMM against the same arithmetic in torch."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.int8_rows import Int8RowsKernel
from tandem.layers.int8 import quantize_rows


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Int8RowsKernel:
    return Int8RowsKernel.build(tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (130, 1536)])
def test_rows_quantize_as_torch_does(kernel, dtype, shape) -> None:
    generator = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(*shape, generator=generator) * torch.rand(shape[0], 1, generator=generator) * 10).to(dtype)
    x[0, :3] = torch.tensor([0.0, 127.0, -63.5])  # exact values, one at a rounding tie
    values, scales = kernel.quantize_rows(x)
    want_values, want_scales = quantize_rows(x)
    # the same arithmetic, but -ffast-math may turn `top / 127` into `top * (1 / 127)` and fold
    # the reciprocal: a scale's last bit may differ, and a value at a rounding tie go either way
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
    differ = values.int() != want_values.int()
    assert (values.int() - want_values.int()).abs().max() <= 1
    ratio = x.float() / want_scales
    assert bool((((ratio[differ].abs() % 1) - 0.5).abs() < 1e-4).all())
    assert values.abs().amax(1).eq(127).all()  # each row's largest magnitude uses the whole range


def test_a_zero_row_quantizes_to_zeros(kernel) -> None:
    values, scales = kernel.quantize_rows(torch.zeros(2, 32))
    assert not values.any() and bool((scales > 0).all())


def test_rows_may_be_a_view_with_a_wider_stride(kernel) -> None:
    wide = torch.randn(5, 96)
    values, scales = kernel.quantize_rows(wide[:, :64])
    dense_values, dense_scales = kernel.quantize_rows(wide[:, :64].contiguous())
    assert torch.equal(values, dense_values) and torch.equal(scales, dense_scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bias", "residual"), [(False, False), (True, False), (True, True), (False, True)])
def test_dequantize_scales_and_adds(kernel, dtype, bias, residual) -> None:
    generator = torch.Generator().manual_seed(7)
    products = torch.randint(-40000, 40000, (9, 48), generator=generator, dtype=torch.int32)
    row_scales = torch.rand(9, 1, generator=generator) / 100
    col_scales = torch.rand(48, generator=generator) / 100
    bias_t = torch.randn(48, generator=generator).to(dtype) if bias else None
    residual_t = torch.randn(9, 48, generator=generator).to(dtype) if residual else None
    got = kernel.dequantize(products, row_scales, col_scales, dtype, bias_t, residual_t)
    want = products.float() * row_scales * col_scales
    if bias_t is not None:
        want = want + bias_t.float()
    if residual_t is not None:
        want = want + residual_t.float()
    assert got.dtype == dtype
    # fp32: the same products, to the last bit or two (the C build may fuse a multiply-add);
    # bf16: rounded once, at the end
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-2}
    torch.testing.assert_close(got, want.to(dtype), **tolerance)


def test_what_the_kernel_takes(kernel) -> None:
    assert kernel.takes(torch.zeros(2, 8), 16)
    assert kernel.takes(torch.zeros(2, 8, dtype=torch.bfloat16), 16)
    assert not kernel.takes(torch.zeros(2, 8, dtype=torch.float16), 16)
    assert not kernel.takes(torch.zeros(8, 2).t(), 16)  # columns not dense
    assert not kernel.takes(torch.zeros(2, 8), kernel.max_cols + 1)
