"""The C passes around the 8-bit GEMM against the same arithmetic in torch."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest
import torch

from tandem.kernels.int8_rows import SOURCE, Int8RowsKernel, QuantizedRows
from tandem.layers.int8 import quantize_rows, quantize_rows_with_outliers


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Int8RowsKernel:
    return Int8RowsKernel.build(tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (130, 1536)])
def test_rows_quantize_as_torch_does(kernel, dtype, shape) -> None:
    generator = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(*shape, generator=generator) * torch.rand(shape[0], 1, generator=generator) * 10).to(dtype)
    x[0, :3] = torch.tensor([0.0, 127.0, -63.5])  # exact values, one at a rounding tie
    values, scales, _, _ = kernel.quantize_rows(x)
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
    values, scales, _, _ = kernel.quantize_rows(torch.zeros(2, 32))
    assert not values.any() and bool((scales > 0).all())


def test_rows_may_be_a_view_with_a_wider_stride(kernel) -> None:
    wide = torch.randn(5, 96)
    rows = kernel.quantize_rows(wide[:, :64], outliers=4)
    dense = kernel.quantize_rows(wide[:, :64].contiguous(), outliers=4)
    assert all(torch.equal(a, b) for a, b in zip(rows, dense, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bias", "residual"), [(False, False), (True, False), (True, True), (False, True)])
def test_dequantize_scales_and_adds(kernel, dtype, bias, residual) -> None:
    generator = torch.Generator().manual_seed(7)
    products = torch.randint(-40000, 40000, (9, 48), generator=generator, dtype=torch.int32)
    row_scales = torch.rand(9, 1, generator=generator) / 100
    col_scales = torch.rand(48, generator=generator) / 100
    bias_t = torch.randn(48, generator=generator).to(dtype) if bias else None
    residual_t = torch.randn(9, 48, generator=generator).to(dtype) if residual else None
    rows = QuantizedRows(torch.empty(0), row_scales, torch.empty(9, 0, dtype=torch.int32), torch.empty(9, 0))
    got = kernel.dequantize(products, rows, col_scales, None, dtype, bias_t, residual_t)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_rows_largest_magnitudes_are_set_aside_exactly(kernel, dtype) -> None:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(6, 576, generator=generator)
    x[:, 17] = 80.0  # a channel far above the rest in every row, as in a down projection's input
    x[2, 300] = -500.0
    x = x.to(dtype)
    got = kernel.quantize_rows(x, outliers=4)
    want = quantize_rows_with_outliers(x, 4)
    assert torch.equal(got.outlier_index.sort(1).values, want.outlier_index.sort(1).values)
    assert torch.equal(got.outlier_value.abs().sort(1).values, want.outlier_value.abs().sort(1).values)
    assert bool((got.outlier_index == 17).any(1).all()) and int(got.outlier_index[2, 0]) == 300
    assert float(got.outlier_value[2, 0]) == -500.0  # largest first, the exact value
    taken = torch.zeros_like(got.values, dtype=torch.bool).scatter_(1, got.outlier_index.long(), True)
    assert not got.values[taken].any()  # zero in the int8 row
    # the rest spans the whole int8 range at a scale the outliers no longer set
    assert got.values.abs().amax(1).eq(127).all()
    torch.testing.assert_close(got.scales, want.scales, rtol=1e-6, atol=0)
    assert float(got.scales.max()) < 10 / 127
    with pytest.raises(ValueError, match="outlier channels"):
        kernel.quantize_rows(x, outliers=kernel.max_outliers + 1)


def test_dequantize_adds_the_outliers_through_the_transposed_weight(kernel) -> None:
    generator = torch.Generator().manual_seed(12)
    weight_t = torch.randint(-127, 128, (64, 40), generator=generator, dtype=torch.int8)
    products = torch.randint(-9000, 9000, (3, 40), generator=generator, dtype=torch.int32)
    row_scales = torch.rand(3, 1, generator=generator) / 50
    col_scales = torch.rand(40, generator=generator) / 50
    index = torch.tensor([[5, 0], [63, 7], [7, 5]], dtype=torch.int32)
    value = torch.randn(3, 2, generator=generator) * 30
    rows = QuantizedRows(torch.empty(0), row_scales, index, value)
    got = kernel.dequantize(products, rows, col_scales, weight_t, torch.float32, None, None)
    extra = torch.einsum("mj,mjn->mn", value, weight_t[index.long()].float())
    torch.testing.assert_close(got, (products.float() * row_scales + extra) * col_scales, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="transposed weight"):
        kernel.dequantize(products, rows, col_scales, None, torch.float32, None, None)


def test_the_isa_is_named(kernel) -> None:
    assert kernel.isa in ("avx512", "portable C")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Int8RowsKernel:
    """The plain loops, built for an older target (machines differ: AVX2-only EPYCs, AVX-512
    Xeons)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 instruction sets")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    library = tmp_path_factory.mktemp("plain") / "int8-rows-x86-64.so"
    subprocess.run([compiler, "-O3", "-march=x86-64", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-shared",
                    "-fPIC", "-std=c11", str(SOURCE), "-o", str(library), "-lm"], check=True, capture_output=True)
    built = Int8RowsKernel(library)
    assert built.isa == "portable C"
    return built


@pytest.mark.parametrize("cols", [3, 16, 200, 576, 1536])
@pytest.mark.parametrize("outliers", [1, 4, 15, 16, 20])
def test_outliers_are_the_plain_paths_in_every_row_shape(kernel, plain, cols, outliers) -> None:
    """The vector path finds candidates by a bound from its lane maxima and ranks at most 16
    of them in a vector, else it takes the plain selection: both sides of that split, bit for
    bit, ties to the lower column. Rows: Gaussian with a few channels far above the rest (a
    handful of candidates), few levels (wide ties, many candidates), zeros, one lane's
    chunk all equal, fewer columns than outliers."""
    generator = torch.Generator().manual_seed(cols * 100 + outliers)
    rows = [torch.randn(cols, generator=generator) for _ in range(4)]
    for row in rows[:2]:
        row[torch.randint(0, cols, (3,), generator=generator)] *= 40.0
    rows.append(torch.randint(-3, 4, (cols,), generator=generator).float())  # few levels: ties everywhere
    rows.append(torch.zeros(cols))
    rows.append(torch.full((cols,), -2.5))
    spiky = torch.randn(cols, generator=generator)
    spiky[::16] = 9.0  # every chunk's lane 0 equal and largest
    rows.append(spiky)
    x = torch.stack(rows)
    for dtype in (torch.float32, torch.bfloat16):
        got, want = kernel.quantize_rows(x.to(dtype), outliers), plain.quantize_rows(x.to(dtype), outliers)
        assert torch.equal(got.outlier_index, want.outlier_index)
        assert torch.equal(got.outlier_value, want.outlier_value)
        assert torch.equal(got.values, want.values) and torch.equal(got.scales, want.scales)


def test_the_plain_c_path_computes_what_this_cpus_path_does(kernel, plain) -> None:
    """The plain loops against this build, on rows with tails, outliers, a zero row and a tie."""
    generator = torch.Generator().manual_seed(21)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(9, 200, generator=generator) * 3).to(dtype)  # 200: a 8-wide tail past 12 chunks
        x[1] = 0.0
        x[2, 5] = x[2, 150] = 40.0  # a tie between outliers: the lower column first
        x[3, 199] = -90.0  # an outlier in the tail
        got, want = kernel.quantize_rows(x, 4), plain.quantize_rows(x, 4)
        assert torch.equal(got.values, want.values) and torch.equal(got.scales, want.scales)
        assert torch.equal(got.outlier_value, want.outlier_value)
        assert torch.equal(got.outlier_index, want.outlier_index)  # the zero row's too: its lowest columns
        assert got.outlier_index[2, :2].tolist() == [5, 150] and int(got.outlier_index[3, 0]) == 199
        weight_t = torch.randint(-127, 128, (200, 72), generator=generator, dtype=torch.int8)
        products = torch.randint(-9000, 9000, (9, 72), generator=generator, dtype=torch.int32)
        col_scales = torch.rand(72, generator=generator) / 50
        bias, residual = torch.randn(72, generator=generator).to(dtype), torch.randn(9, 72, generator=generator).to(dtype)
        for out_dtype in {dtype, torch.float32}:
            torch.testing.assert_close(
                kernel.dequantize(products, got, col_scales, weight_t, out_dtype, bias, residual),
                plain.dequantize(products, got, col_scales, weight_t, out_dtype, bias, residual),
                rtol=1e-5, atol=1e-5)
        gated = [k.gated_quantize(products.repeat(1, 2)[:, :144], got, col_scales.repeat(2)[:144],
                                  weight_t.repeat(1, 2)[:, :144].contiguous(), dtype, 4) for k in (kernel, plain)]
        assert (gated[0].values.int() - gated[1].values.int()).abs().max() <= 1  # exp16 against expf
        torch.testing.assert_close(gated[0].scales, gated[1].scales, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_pass_is_dequantize_silu_and_mul_then_quantize(kernel, dtype) -> None:
    """One pass for the middle of an 8-bit MLP: the same rows as the three passes one after
    another (in bf16 with their roundings), up to silu's exp in the last bit: a value at a
    rounding tie may land one step apart."""
    generator = torch.Generator().manual_seed(31)
    inter = 200  # a tail past the last 16
    weight_t = torch.randint(-127, 128, (96, 2 * inter), generator=generator, dtype=torch.int8)
    products = torch.randint(-20000, 20000, (9, 2 * inter), generator=generator, dtype=torch.int32)
    x = torch.randn(9, 96, generator=generator)
    x[:, 7] = 30.0  # an outlier channel in the gate/up input
    rows_in = kernel.quantize_rows(x.to(dtype), 4)
    col_scales = torch.rand(2 * inter, generator=generator) / 2000
    got = kernel.gated_quantize(products, rows_in, col_scales, weight_t, dtype, 4)
    gate_up = kernel.dequantize(products, rows_in, col_scales, weight_t, dtype, None, None)
    gate, up = gate_up.split(inter, dim=-1)
    want = kernel.quantize_rows(torch.nn.functional.silu(gate) * up, 4)
    torch.testing.assert_close(got.scales, want.scales, rtol=1e-5, atol=0)
    assert (got.values.int() - want.values.int()).abs().max() <= 1
    assert (got.values != want.values).float().mean() < 0.01
    assert torch.equal(got.outlier_index, want.outlier_index)
    torch.testing.assert_close(got.outlier_value, want.outlier_value, rtol=1e-5, atol=0)
