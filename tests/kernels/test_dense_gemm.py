"""tandem's packed fp32 / bf16 GEMM (csrc/dense_gemm.c): the products, bias and residual of
F.linear, summed in another order and rounded once, for every tile shape; and the gated form,
silu(gate) * up of a gate/up matrix from the same tiles."""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem.kernels.dense_gemm import SOURCE, DenseGemmKernel, load_dense_gemm_kernel
from tandem.platform.cpu_modes import CpuFeatures
from tests.support.kernel_builds import build_for

FEATURES = CpuFeatures.detect()


@pytest.fixture(scope="module", params=["native", "haswell"])
def kernel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> DenseGemmKernel:
    """The kernel as this CPU runs it, and built for an AVX2-only CPU (its 8-lane fp32 tiles),
    so an AVX-512 box tests both paths."""
    if request.param == "native":
        built = DenseGemmKernel.build(tmp_path_factory.mktemp("cache"))
    else:
        if platform.machine() not in ("x86_64", "AMD64") or not FEATURES.avx2_fma:
            pytest.skip("this CPU cannot run AVX2 code")
        built = DenseGemmKernel(build_for(SOURCE, "haswell", tmp_path_factory.mktemp("haswell")))
        assert built.isa == "avx2"
    if not built.multiplies(torch.float32):
        pytest.skip("the packed dense GEMM needs AVX-512 or AVX2 + FMA")
    return built


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _dtypes(kernel: DenseGemmKernel) -> list[torch.dtype]:
    return [d for d in (torch.float32, torch.bfloat16) if kernel.multiplies(d)]


def test_the_isa_follows_the_cpu(tmp_path: Path) -> None:
    built = DenseGemmKernel.build(tmp_path)
    want = ("amx-bf16" if FEATURES.amx and FEATURES.avx512_bf16 else "avx512-bf16" if FEATURES.avx512_bf16
            else "avx512" if FEATURES.avx512 else "avx2" if FEATURES.avx2_fma else "none")
    assert built.isa == want
    assert (load_dense_gemm_kernel(tmp_path) is None) == (want == "none")


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 16, 17, 33, 64, 130])
@pytest.mark.parametrize("in_features, out_features", [(2, 16), (96, 80), (576, 960), (1536, 64)])
def test_products_bias_and_residual_are_f_linears(kernel, rows, in_features, out_features) -> None:
    """Against F.linear in fp64: fp32 to fp32 rounding, bf16 within one bf16 step of the
    fp64 result rounded once (the kernel sums in fp32, then rounds once)."""
    generator = torch.Generator().manual_seed(rows + in_features)
    for dtype in _dtypes(kernel):
        weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
        packed = kernel.pack(weight)
        assert torch.equal(packed.weight(), weight)
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        bias = torch.randn(out_features, generator=generator).to(dtype)
        residual = torch.randn(rows, out_features, generator=generator).to(dtype)
        exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double()) + residual.double()
        for got, want in ((kernel.matmul(x, packed, bias, residual), exact),
                          (kernel.matmul(x, packed), x.double() @ weight.double().t())):
            assert got.dtype == dtype and got.shape == (rows, out_features)
            if dtype == torch.float32:
                torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * in_features ** 0.5)
            else:
                step = want.abs().clamp_min(1e-3) * 2.0 ** -7  # one bf16 step
                assert ((got.double() - want).abs() <= step + 1e-4 * in_features ** 0.5).all()


@pytest.mark.parametrize("rows", [1000, 2049])
@pytest.mark.parametrize("in_features, out_features", [(576, 960), (1536, 64)])
def test_products_over_several_row_groups(kernel, rows, in_features, out_features) -> None:
    """Rows past one group of the AMX product (544 rows at K = 576, 192 at 1,536), dealt over
    groups whose sizes differ by a 32-row unit: every row multiplied once, by every panel."""
    generator = torch.Generator().manual_seed(rows + in_features)
    for dtype in _dtypes(kernel):
        weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        got = kernel.matmul(x, kernel.pack(weight)).double()
        want = x.double() @ weight.double().t()
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * in_features ** 0.5)
        else:
            step = want.abs().clamp_min(1e-3) * 2.0 ** -7
            assert ((got - want).abs() <= step + 1e-4 * in_features ** 0.5).all()


def _gated_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    gate_up = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("in_features, intermediate", [(2, 16), (96, 48), (576, 64), (64, 1536)])
def test_gated_products_are_silu_of_gate_times_up(kernel, rows, in_features, intermediate) -> None:
    """Every tile (1-6 rows; a panel of one gate/up pair or two) against fp64: fp32 to fp32
    rounding, bf16 within one bf16 step of the fp64 result rounded once."""
    generator = torch.Generator().manual_seed(rows * intermediate + in_features)
    for dtype in _dtypes(kernel):
        weight = (torch.randn(2 * intermediate, in_features, generator=generator) / in_features ** 0.5).to(dtype)
        packed = kernel.pack_gated(weight)
        pairs = weight.reshape(2, intermediate // 16, 16, in_features).transpose(0, 1)
        assert torch.equal(packed.weight(), pairs.reshape(2 * intermediate, in_features))  # gate, up, gate, ...
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        bias = torch.randn(2 * intermediate, generator=generator).to(dtype)
        for with_bias in (bias, None):
            got, want = kernel.silu_mul(x, packed, with_bias), _gated_reference(x, weight, with_bias)
            assert got.dtype == dtype and got.shape == (rows, intermediate)
            if dtype == torch.float32:
                torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
            else:
                step = want.abs().clamp_min(1e-3) * 2.0 ** -7
                assert ((got.double() - want).abs() <= step + 1e-3).all()


def test_gated_silu_at_the_extremes(kernel) -> None:
    """silu(g) for g far below and above zero (-0 and g itself, exp's overflow and underflow
    handled), a NaN stays a NaN, the thread split and a row-strided view change no bit."""
    intermediate, in_features = 32, 8
    weight = torch.zeros(2 * intermediate, in_features)
    weight[:intermediate, 0] = torch.linspace(-300, 300, intermediate)  # gate = a column of x[:, 0]
    weight[intermediate:, 1] = 1.0  # up = x[:, 1]
    x = torch.zeros(3, in_features)
    x[:, 0], x[:, 1] = torch.tensor([1.0, 0.5, float("nan")]), 2.0
    for dtype in _dtypes(kernel):
        packed = kernel.pack_gated(weight.to(dtype))
        got = kernel.silu_mul(x.to(dtype), packed).double()
        want = _gated_reference(x[:2].to(dtype), weight.to(dtype), None)
        torch.testing.assert_close(got[:2], want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-30)
        assert got[0, 0] == 0 and got[0, -1] == 600  # silu(-300) * 2, silu(300) * 2
        assert got[2].isnan().all()
        wide = torch.randn(40, in_features + 3).to(dtype)
        view = wide[:, :in_features]
        reference = kernel.silu_mul(view.contiguous(), packed)
        with _one_thread():
            assert torch.equal(kernel.silu_mul(view, packed), reference)


def test_a_row_strided_view_and_the_thread_split(kernel) -> None:
    generator = torch.Generator().manual_seed(5)
    for dtype in _dtypes(kernel):
        weight = torch.randn(576, 64, generator=generator).to(dtype)
        packed = kernel.pack(weight)
        wide = torch.randn(40, 80, generator=generator).to(dtype)
        x = wide[:, :64]
        assert x.stride(0) == 80
        got = kernel.matmul(x, packed)
        assert torch.equal(got, kernel.matmul(x.contiguous(), packed))
        with _one_thread():
            assert torch.equal(kernel.matmul(x, packed), got)


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_any_thread_count_gives_one_threads_bits(kernel, threads) -> None:
    """Items (row groups by panels) split over 2, 3 or 4 threads, several groups at 700 rows:
    every unit multiplied once, whichever thread takes it, so the bits are one thread's."""
    generator = torch.Generator().manual_seed(threads)
    for dtype in _dtypes(kernel):
        weight = torch.randn(960, 576, generator=generator).to(dtype)
        packed = kernel.pack(weight)
        x = torch.randn(700, 576, generator=generator).to(dtype)
        with _one_thread():
            want = kernel.matmul(x, packed)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = kernel.matmul(x, packed)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(got, want)


def test_shapes_and_rows_it_refuses(kernel) -> None:
    assert not kernel.fits(torch.zeros(40, 64))  # not a multiple of 16 outputs
    assert not kernel.fits(torch.zeros(32, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="out % 16 == 0"):
        kernel.pack(torch.zeros(40, 64))
    packed = kernel.pack(torch.zeros(32, 64))
    with pytest.raises(ValueError, match="dense last dimension"):
        kernel.matmul(torch.zeros(4, 63), packed)
    with pytest.raises(ValueError, match="dense last dimension"):
        kernel.matmul(torch.zeros(4, 64, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="intermediate % 16 == 0"):
        kernel.pack_gated(torch.zeros(48, 64))  # 24 intermediate columns
    with pytest.raises(ValueError, match="dense last dimension"):
        kernel.silu_mul(torch.zeros(4, 63), kernel.pack_gated(torch.zeros(64, 64)))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_an_avx2_build_multiplies_fp32_only_and_a_plain_one_nothing(tmp_path: Path) -> None:
    avx2 = DenseGemmKernel(build_for(SOURCE, "haswell", tmp_path))
    assert avx2.isa == "avx2" and avx2.multiplies(torch.float32) and not avx2.multiplies(torch.bfloat16)
    assert not avx2.fits(torch.zeros(32, 64, dtype=torch.bfloat16))
    plain = DenseGemmKernel(build_for(SOURCE, "x86-64", tmp_path))
    assert plain.isa == "none" and not plain.fits(torch.zeros(32, 64))


@pytest.mark.skipif(not (FEATURES.amx and FEATURES.avx512_bf16), reason="AMX's bf16 tiles")
def test_amx_tiles_and_the_avx512_bf16_tiles_both_give_the_product(tmp_path: Path) -> None:
    """On a CPU with AMX the bf16 products run on the tiles (K a multiple of 32; units of up to
    two 16-row tiles, the last with fewer rows), a build for a CPU without AMX on AVX-512-BF16:
    both within a bf16 step of fp64, plain and gated, and a K the tiles cannot take falls back.
    The native build is this test's own: the module's `kernel` fixture is also the AVX2 one."""
    kernel = DenseGemmKernel.build(tmp_path / "native")
    vector = DenseGemmKernel(build_for(SOURCE, "cooperlake", tmp_path))
    assert kernel.isa == "amx-bf16" and vector.isa == "avx512-bf16"
    generator = torch.Generator().manual_seed(11)
    for rows, in_features, out_features in ((1, 576, 960), (15, 64, 64), (16, 576, 64), (31, 1536, 576),
                                            (47, 96, 96), (100, 576, 3072), (33, 48, 32)):
        weight = (torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5).bfloat16()
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        residual = torch.randn(rows, out_features, generator=generator).bfloat16()
        want = x.double() @ weight.double().t() + residual.double()
        gated_want = _gated_reference(x, weight, None)
        step = want.abs().clamp_min(1e-3) * 2.0 ** -7
        gated_step = gated_want.abs().clamp_min(1e-3) * 2.0 ** -7
        for built in (kernel, vector):
            got = built.matmul(x, built.pack(weight), None, residual).double()
            assert ((got - want).abs() <= step + 1e-4 * in_features ** 0.5).all(), (built.isa, rows, in_features)
            gated = built.silu_mul(x, built.pack_gated(weight)).double()
            assert ((gated - gated_want).abs() <= gated_step + 1e-3).all(), (built.isa, rows, in_features)


def test_the_kernel_s_own_rate_is_measured_for_the_dtypes_it_multiplies(kernel: DenseGemmKernel) -> None:
    """The bench's matmul ceiling takes the faster of torch's and this kernel's rate; a dtype
    or shape the kernel does not multiply counts as no rate, not as an error."""
    from tandem.kernels.dense_gemm import packed_gemm_flops_per_s

    for dtype in (torch.float32, torch.bfloat16):
        rate = packed_gemm_flops_per_s(kernel, dtype, 64, 96, 80, repeats=1)
        assert (rate > 0) == kernel.multiplies(dtype)
    assert packed_gemm_flops_per_s(kernel, torch.float32, 64, 96, 72, repeats=1) == 0.0  # 72 columns: not blocks


def _head_rows(generator: torch.Generator, rows: int, in_features: int, out_features: int):
    """A greedy head's inputs: bf16 activations and a [vocab, hidden] matrix."""
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5).bfloat16()
    return torch.randn(rows, in_features, generator=generator).bfloat16(), weight


@pytest.mark.skipif(not (FEATURES.amx and FEATURES.avx512_bf16), reason="AMX's bf16 tiles")
@pytest.mark.parametrize(("rows", "out_features"), [(1, 4096), (17, 49152), (64, 49152), (100, 3072), (700, 1024)])
def test_the_greedy_argmax_is_the_argmax_of_the_product_it_does_not_write(tmp_path: Path, rows, out_features) -> None:
    """A greedy LM head's ids without its logits: each row's argmax of the bf16 product the GEMM
    would write, over row units and panels split between the threads (700 rows: several row
    groups), one thread or all."""
    kernel = DenseGemmKernel.build(tmp_path)
    x, weight = _head_rows(torch.Generator().manual_seed(rows), rows, 576, out_features)
    packed = kernel.pack(weight)
    want = kernel.matmul(x, packed).argmax(dim=-1)
    assert torch.equal(kernel.argmax(x, packed), want)
    with _one_thread():
        assert torch.equal(kernel.argmax(x, packed), want)


@pytest.mark.skipif(not (FEATURES.amx and FEATURES.avx512_bf16), reason="AMX's bf16 tiles")
def test_the_greedy_argmax_takes_the_first_of_equal_maxima_and_the_first_nan(tmp_path: Path) -> None:
    """Columns equal to the row's maximum in other lanes, panels and threads' halves: the first
    wins, as torch.argmax's; a NaN column wins over any value, the first NaN over later ones;
    a row whose every product overflows to -inf is column 0's."""
    kernel = DenseGemmKernel.build(tmp_path)
    x, weight = _head_rows(torch.Generator().manual_seed(3), 40, 576, 8192)
    want_rows = (x.float() @ weight.float().t()).argmax(dim=-1)
    for copy in (7, 4100, 8191):  # later columns equal to every row's winner
        weight[copy] = weight[int(want_rows[0])]
    x[1:] = x[0]  # every row is row 0, whose winner now has three copies
    packed = kernel.pack(weight)
    ids = kernel.argmax(x, packed)
    assert torch.equal(ids, kernel.matmul(x, packed).argmax(dim=-1))
    assert int(ids[0]) == min(7, int(want_rows[0]))
    nan = weight.clone()
    nan[6000, 0] = float("nan")
    nan[5000, 3] = float("nan")
    assert torch.equal(kernel.argmax(x, kernel.pack(nan)), torch.full((40,), 5000))
    overflow = torch.zeros(3, 576, dtype=torch.bfloat16)
    overflow[:, :2] = 2.0
    low = torch.zeros(64, 576, dtype=torch.bfloat16)
    low[:, :2] = -3e38
    packed_low = kernel.pack(low)
    assert torch.isneginf(kernel.matmul(overflow, packed_low).float()).all()
    assert torch.equal(kernel.argmax(overflow, packed_low), torch.zeros(3, dtype=torch.int64))


def test_the_greedy_argmax_is_left_to_the_caller_where_the_tiles_cannot(kernel: DenseGemmKernel) -> None:
    """fp32, a K the tiles do not take, or a build without AMX: None, and the caller multiplies."""
    generator = torch.Generator().manual_seed(4)
    x, weight = _head_rows(generator, 4, 64, 64)
    assert kernel.argmax(x.float(), kernel.pack(weight.float())) is None
    if kernel.multiplies(torch.bfloat16):
        x48, weight48 = _head_rows(generator, 4, 48, 64)
        assert kernel.argmax(x48, kernel.pack(weight48)) is None
        taken = kernel.argmax(x, kernel.pack(weight))
        assert (taken is not None) == (kernel.isa == "amx-bf16")
