"""tandem's packed int8 GEMM (csrc/int8_gemm.c): the integers torch._int_mm gives, for every
tile shape and thread split; the dequantizing form, the separate dequantize pass's bits; AMX's
int8 tiles (csrc/int8_gemm_amx.h) and the vpdpbusd tiles giving the same bits; and a build
without VNNI that refuses rather than guesses."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from tandem.kernels.int8_gemm import SOURCE, Int8GemmKernel, PackedInt8, load_int8_gemm_kernel
from tandem.layers.int8 import int_mm
from tandem.platform.cpu_modes import CpuFeatures
from tests.support.kernel_builds import build_for

VNNI = CpuFeatures.detect().avx512_vnni
AMX = CpuFeatures.detect().amx
needs_vnni = pytest.mark.skipif(not VNNI, reason="the packed GEMM's only path needs AVX-512-VNNI")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Int8GemmKernel:
    return Int8GemmKernel.build(tmp_path_factory.mktemp("cache"))


def _reference(a: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """int64 products summed exactly, as int32."""
    return (a.long() @ columns.long()).to(torch.int32)


def test_the_isa_follows_the_cpu(kernel) -> None:
    assert kernel.isa == ("amx-int8" if AMX and VNNI else "avx512-vnni" if VNNI else "none")


def test_packing_keeps_every_value_and_the_column_sums(kernel) -> None:
    if not VNNI:
        pytest.skip("packing needs the VNNI build")
    generator = torch.Generator().manual_seed(1)
    columns = torch.randint(-128, 128, (40, 48), generator=generator, dtype=torch.int8)
    packed = kernel.pack(columns)
    assert packed.in_features == 40 and packed.out_features == 48
    assert torch.equal(packed.columns(), columns)
    assert torch.equal(packed.values[1, 3, 5], columns[12:16, 16 + 5])  # element (k, n) at [n/16, k/4, n%16, k%4]
    assert torch.equal(packed.compensation, 128 * columns.int().sum(0))


@needs_vnni
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64, 131])
@pytest.mark.parametrize("in_features, out_features", [(8, 16), (96, 80), (576, 960), (1536, 64)])
def test_products_are_torch_int_mms(kernel, rows, in_features, out_features) -> None:
    """Tiles of 1-6 rows and 1-4 column blocks (80 = a panel and one block), rows split between
    the threads or not, against torch._int_mm and an exact int64 sum."""
    generator = torch.Generator().manual_seed(rows * 7 + in_features)
    columns = torch.randint(-128, 128, (in_features, out_features), generator=generator, dtype=torch.int8)
    a = torch.randint(-128, 128, (rows, in_features), generator=generator, dtype=torch.int8)
    got = kernel.matmul(a, kernel.pack(columns))
    assert got.dtype == torch.int32 and got.shape == (rows, out_features)
    assert torch.equal(got, _reference(a, columns))
    if in_features >= 16 and rows > 16:  # torch._int_mm takes more than 16 rows
        assert torch.equal(got, int_mm(a, columns))


@needs_vnni
def test_extremes_and_a_row_strided_view(kernel) -> None:
    """-128 and 127 everywhere (the +128 flip and its compensation at their limits), and rows
    read through a view whose rows lie further apart than their length."""
    columns = torch.full((1536, 32), -128, dtype=torch.int8)
    columns[:, 16:] = 127
    wide = torch.full((12, 1600), 7, dtype=torch.int8)
    wide[:, :1536] = -128
    wide[::2, :1536] = 127
    a = wide[:, :1536]
    assert a.stride(0) == 1600
    got = kernel.matmul(a, kernel.pack(columns))
    assert torch.equal(got, _reference(a.contiguous(), columns))


@needs_vnni
@pytest.mark.parametrize(("rows", "threads"), [(64, None), (300, 2), (300, 3)])
def test_the_thread_split_does_not_change_the_products(kernel, rows, threads) -> None:
    """One thread's bits over 2 and 3 threads, at 64 rows and at 300 (several row units)."""
    generator = torch.Generator().manual_seed(3)
    columns = torch.randint(-128, 128, (64, 576), generator=generator, dtype=torch.int8)
    a = torch.randint(-128, 128, (rows, 64), generator=generator, dtype=torch.int8)
    packed = kernel.pack(columns)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.matmul(a, packed)
        torch.set_num_threads(threads or before)
        assert torch.equal(one, kernel.matmul(a, packed))
    finally:
        torch.set_num_threads(before)


def test_shapes_it_refuses(kernel) -> None:
    assert not kernel.fits(96, 40)  # columns not a multiple of 16
    assert not kernel.fits(6, 16)  # inner size not a multiple of 4
    assert not kernel.fits(kernel.max_inner + 4, 16)
    with pytest.raises(ValueError, match="in % 4 == 0 and out % 16 == 0"):
        kernel.pack(torch.zeros(96, 40, dtype=torch.int8))
    if VNNI:
        packed = kernel.pack(torch.zeros(96, 32, dtype=torch.int8))
        with pytest.raises(ValueError, match="dense last dimension"):
            kernel.matmul(torch.zeros(4, 95, dtype=torch.int8), packed)
        with pytest.raises(ValueError, match="dense last dimension"):
            kernel.matmul(torch.zeros(96, 4, dtype=torch.int8).t(), packed)


@pytest.fixture(scope="module")
def rows_kernel(tmp_path_factory: pytest.TempPathFactory):
    from tandem.kernels.int8_rows import load_int8_rows_kernel

    loaded = load_int8_rows_kernel(tmp_path_factory.mktemp("rows"))
    if loaded is None or loaded.isa != "avx512":
        pytest.skip("the separate pass's vector build is the reference")
    return loaded


@needs_vnni
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("in_features, out_features", [(8, 16), (96, 48), (576, 160)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dequantizing_gemm_gives_the_separate_passs_bits(kernel, rows_kernel, rows, in_features, out_features,
                                                              dtype) -> None:
    """Every tile shape, with and without outliers, bias and residual: the epilogue's output
    equals the int32 products dequantized by int8_rows.c's pass, bit for bit. Outlier counts:
    none and tandem's 4 (the epilogue's unrolled rows), 3 (its loop over a row's count) and 9
    (more than a row's terms hold: the per-chunk path)."""
    generator = torch.Generator().manual_seed(rows * out_features + in_features)
    columns = torch.randint(-127, 128, (in_features, out_features), generator=generator, dtype=torch.int8)
    packed = kernel.pack(columns)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    col_scales = torch.rand(out_features, generator=generator) / 100
    bias = torch.randn(out_features, generator=generator).to(dtype)
    residual = torch.randn(rows, out_features, generator=generator).to(dtype)
    for outliers in (0, 3, 4, 9):
        quantized = rows_kernel.quantize_rows(x, min(outliers, in_features))
        products = kernel.matmul(quantized.values, packed)
        for extra in ((None, None), (bias, residual)):
            want = rows_kernel.dequantize(products, quantized, col_scales, columns, dtype, *extra)
            got = kernel.matmul_dequantize(quantized.values, packed, quantized.scales, col_scales,
                                           quantized.outlier_index, quantized.outlier_value, columns, dtype, *extra)
            assert got.dtype == dtype and torch.equal(got, want), (outliers, extra[0] is not None)


@needs_vnni
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 64])
@pytest.mark.parametrize("intermediate", [16, 48, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_gemm_gives_the_separate_passs_middle(kernel, rows_kernel, rows, intermediate, dtype) -> None:
    """A gate/up matrix packed in pairs: silu(gate) * up from the epilogue, quantized for the
    down projection, is the separate pass's (dequantize, silu-mul, quantize) bit for bit, with
    no outliers, 3, 4 and 9 a row; panels of one pair and of two."""
    generator = torch.Generator().manual_seed(rows * intermediate)
    in_features = 96
    columns = torch.randint(-127, 128, (in_features, 2 * intermediate), generator=generator, dtype=torch.int8)
    packed = kernel.pack_gate_up(columns)
    pairs = columns.reshape(in_features, 2, intermediate // 16, 16).transpose(1, 2).reshape(in_features, -1)
    assert torch.equal(packed.columns(), pairs)
    x = torch.randn(rows, in_features, generator=generator).to(dtype) * 4
    col_scales = torch.rand(2 * intermediate, generator=generator) / 100
    for outliers in (0, 3, 4, 9):
        quantized = rows_kernel.quantize_rows(x, outliers)
        want = rows_kernel.gated_quantize(kernel.matmul(quantized.values, kernel.pack(columns)), quantized,
                                          col_scales, columns, dtype, outliers)
        h = kernel.gated(quantized.values, packed, quantized.scales, col_scales, quantized.outlier_index,
                         quantized.outlier_value, columns, dtype)
        assert h.shape == (rows, intermediate) and h.dtype == torch.float32
        if dtype == torch.bfloat16:
            assert torch.equal(h, h.to(torch.bfloat16).float())  # bf16's roundings held in fp32
        got = rows_kernel.quantize_rows(h, outliers)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), outliers


@needs_vnni
def test_the_dequantizing_gemm_refuses_what_it_cannot_write(kernel) -> None:
    packed = kernel.pack(torch.zeros(32, 16, dtype=torch.int8))
    a, scales = torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 1)
    no_outliers = (torch.zeros(2, 0, dtype=torch.int32), torch.zeros(2, 0))
    with pytest.raises(ValueError, match="fp32 or bf16"):
        kernel.matmul_dequantize(a, packed, scales, torch.ones(16), *no_outliers, None, torch.float16)
    with pytest.raises(ValueError, match="transposed weight"):
        kernel.matmul_dequantize(a, packed, scales, torch.ones(16), torch.zeros(2, 1, dtype=torch.int32),
                                 torch.ones(2, 1), None, torch.float32)
    with pytest.raises(ValueError, match="intermediate % 16 == 0"):
        kernel.pack_gate_up(torch.zeros(32, 48, dtype=torch.int8))
    with pytest.raises(ValueError, match="fp32 or bf16"):
        kernel.gated(a, kernel.pack_gate_up(torch.zeros(32, 32, dtype=torch.int8)), scales, torch.ones(32),
                     *no_outliers, None, torch.float16)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_a_build_without_vnni_refuses_every_product(tmp_path: Path) -> None:
    """An AVX2 box (or an older target): the library builds, says it has no path, and the
    GEMM returns an error instead of writing anything; the loader gives None."""
    library = build_for(SOURCE, "haswell", tmp_path)
    plain = Int8GemmKernel(library)
    assert plain.isa == "none" and not plain.fits(96, 32)
    fake = PackedInt8(torch.zeros(2, 24, 16, 4, dtype=torch.int8), torch.zeros(32, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="refused"):
        plain.matmul(torch.zeros(4, 96, dtype=torch.int8), fake)
    with pytest.raises(RuntimeError, match="refused"):
        plain.matmul_dequantize(torch.zeros(4, 96, dtype=torch.int8), fake, torch.ones(4, 1), torch.ones(32),
                                torch.zeros(4, 0, dtype=torch.int32), torch.zeros(4, 0), None, torch.float32)
    with pytest.raises(RuntimeError, match="refused"):
        plain.gated(torch.zeros(4, 96, dtype=torch.int8), fake, torch.ones(4, 1), torch.ones(32),
                    torch.zeros(4, 0, dtype=torch.int32), torch.zeros(4, 0), None, torch.float32)


def test_the_loader_gives_the_kernel_only_with_its_vnni_path(tmp_path: Path) -> None:
    loaded = load_int8_gemm_kernel(tmp_path)
    assert (loaded is not None) == VNNI


@pytest.mark.skipif(not (AMX and VNNI), reason="AMX's int8 tiles")
def test_amx_tiles_and_the_vnni_tiles_give_the_same_bits(kernel, rows_kernel, tmp_path: Path) -> None:
    """On a CPU with AMX, products whose K is a multiple of 64 run on the int8 tiles (units of up
    to two 16-row tiles by two blocks, the last tile with fewer rows, a last unit of one block,
    several row groups at K = 4,096), other K on vpdpbusd. A build for a CPU without AMX runs
    them all on vpdpbusd: the int32 products, the dequantizing epilogue (outliers, bias,
    residual, fp32 and bf16) and the gated one are bit for bit the same, on one thread and on two."""
    vnni = Int8GemmKernel(build_for(SOURCE, "icelake-server", tmp_path))
    assert kernel.isa == "amx-int8" and vnni.isa == "avx512-vnni"
    generator = torch.Generator().manual_seed(5)
    threads = torch.get_num_threads()
    cases = ((1, 64, 16), (15, 576, 48), (16, 128, 32), (17, 576, 160), (33, 1536, 80), (64, 576, 960),
             (100, 96, 48), (700, 4096, 64))
    try:
        for num_threads in (1, threads):
            torch.set_num_threads(num_threads)
            for rows, in_features, out_features in cases:
                columns = torch.randint(-128, 128, (in_features, out_features), generator=generator, dtype=torch.int8)
                a = torch.randint(-128, 128, (rows, in_features), generator=generator, dtype=torch.int8)
                got = kernel.matmul(a, kernel.pack(columns))
                assert torch.equal(got, vnni.matmul(a, vnni.pack(columns))), (rows, in_features, out_features)
                assert torch.equal(got, _reference(a, columns)), (rows, in_features, out_features)
                x = torch.randn(rows, in_features, generator=generator) * 4
                x[:, 3] *= 50  # an outlier channel
                col_scales = torch.rand(out_features, generator=generator) / 100
                quantized = rows_kernel.quantize_rows(x, 4)
                for dtype in (torch.float32, torch.bfloat16):
                    bias = torch.randn(out_features, generator=generator).to(dtype)
                    residual = torch.randn(rows, out_features, generator=generator).to(dtype)
                    outputs = [built.matmul_dequantize(quantized.values, built.pack(columns), quantized.scales,
                                                       col_scales, quantized.outlier_index, quantized.outlier_value,
                                                       columns, dtype, bias, residual) for built in (kernel, vnni)]
                    assert torch.equal(*outputs), (rows, in_features, out_features, dtype)
                    if out_features % 32 == 0:
                        middles = [built.gated(quantized.values, built.pack_gate_up(columns), quantized.scales,
                                               col_scales, quantized.outlier_index, quantized.outlier_value,
                                               columns, dtype) for built in (kernel, vnni)]
                        assert torch.equal(*middles), (rows, in_features, out_features, dtype)
    finally:
        torch.set_num_threads(threads)
