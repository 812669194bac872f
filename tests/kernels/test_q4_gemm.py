"""tandem's 4-bit GEMM against the dense matrix its nibbles stand for."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tandem.kernels.q4_gemm import GROUP, SOURCE, Q4Kernel, Q4Matrix, Q5Matrix, Q8Matrix, q4_fits


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Q4Kernel:
    return Q4Kernel.build(tmp_path_factory.mktemp("cache"))


def _int16_groups(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: rounded to int16 per group of 32 with scale max|x| / 32767."""
    groups = x.reshape(*x.shape[:-1], -1, GROUP)
    scale = groups.abs().amax(-1, keepdim=True) / 32767
    return (torch.round(groups / scale.clamp_min(1e-30)) * scale).reshape(x.shape)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("shape", [(48, 64), (50, 128), (96, 896), (160, 1536)])  # 50: a partial tile
def test_gemm_is_int16_activations_times_the_dequantized_matrix(kernel: Q4Kernel, rows: int, shape) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + shape[1])
    weight = torch.randn(shape, generator=generator) / 8
    matrix = Q4Matrix.quantize(weight, kernel)
    x = torch.randn(rows, shape[1], generator=generator)
    dense = matrix.dequantize()
    # The integer dot products use int16 activations; the minimum's term uses the exact ones.
    groups = dense.reshape(shape[0], -1, GROUP)
    mins = matrix.mins.float()
    level_part = (groups - mins.unsqueeze(-1)).reshape(shape)
    expected = _int16_groups(x) @ level_part.T + x.reshape(rows, -1, GROUP).sum(-1) @ mins.T
    got = matrix.matmul(x)
    assert got.shape == (rows, shape[0]) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # ...and within 0.1% of the exact product's largest entry (int8 activations, llama.cpp's
    # scheme, land 6-9x outside this bound on these shapes).
    exact = x @ dense.T
    assert (got - exact).abs().max() <= 1e-3 * exact.abs().max()


def test_quantized_grid_and_layout(kernel: Q4Kernel) -> None:
    torch.manual_seed(0)
    weight = torch.randn(16, 128)
    matrix = Q4Matrix.quantize(weight, kernel)
    assert matrix.nibbles.shape == (16, 64) and matrix.scales.shape == matrix.mins.shape == (16, 4)
    assert matrix.nbytes == 16 * 64 + 2 * 16 * 4 * 2
    dense = matrix.dequantize()
    step = matrix.scales.float().repeat_interleave(GROUP, dim=1)
    assert ((dense - weight).abs() <= step / 2 + 1e-3).all()
    # Input j of a 64-block sits in byte j's low nibble, input j + 32 in its high nibble.
    levels = ((weight[0, 32] - matrix.mins[0, 1].float()) / matrix.scales[0, 1].float()).round().clamp(0, 15)
    assert int(matrix.nibbles[0, 0]) >> 4 == int(levels)


def test_bf16_activations_come_back_in_bf16(kernel: Q4Kernel) -> None:
    torch.manual_seed(1)
    matrix = Q4Matrix.quantize(torch.randn(32, 64), kernel)
    x = torch.randn(2, 64).bfloat16()
    out = matrix.matmul(x)
    assert out.dtype == torch.bfloat16
    # widened exactly in C, the same fp32 arithmetic, rounded to nearest even on the way out
    assert torch.equal(out, matrix.matmul(x.float()).bfloat16())


def test_shapes_it_cannot_take(kernel: Q4Kernel) -> None:
    assert q4_fits(torch.empty(24, 64)) and not q4_fits(torch.empty(24, 96))
    with pytest.raises(ValueError, match="in % 64"):
        Q4Matrix.quantize(torch.empty(8, 96), kernel)


def test_the_isa_is_named(kernel: Q4Kernel) -> None:
    assert kernel.isa in ("avx512-vnni", "avx2", "portable C")


def _built_for(march: str, tmp_path: Path) -> Path:
    """The kernel compiled for `march` (skips the test without a C compiler)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    library = tmp_path / f"q4-{march}.so"
    subprocess.run([compiler, "-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", "-std=c11", str(SOURCE),
                    "-o", str(library), "-lm"], check=True, capture_output=True)
    return library


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize("march, isa", [("x86-64", "portable C"), ("haswell", "avx2")])
def test_every_instruction_set_path_computes_the_same(kernel: Q4Kernel, tmp_path: Path, march: str, isa: str) -> None:
    """The machines this runs on differ (AVX2-only EPYCs, AVX-512 Xeons): the paths this CPU
    does not pick by itself are built for an older target and checked against it."""
    library = _built_for(march, tmp_path)
    other = Q4Kernel(library)
    assert other.isa == isa
    torch.manual_seed(2)
    weight = torch.randn(66, 256) / 8  # 66: whole tiles and a partial one on every path
    for scheme in (Q4Matrix, Q5Matrix, Q8Matrix):  # 8-bit levels reach +-127: AVX2 must not saturate
        ours, theirs = scheme.quantize(weight, kernel), scheme.quantize(weight, other)
        assert torch.equal(ours.nibbles, theirs.nibbles)
        for rows in (1, 3):  # one row: a step's second accumulator
            x = torch.randn(rows, 256)
            torch.testing.assert_close(theirs.matmul(x), ours.matmul(x), rtol=1e-5, atol=1e-5)
    # 5 bits with minimums (levels 0..31): the unsigned read of the fifth bit
    ours, theirs = _q5_with_minimums(Q5Matrix.quantize(weight, kernel)), _q5_with_minimums(
        Q5Matrix.quantize(weight, other))
    x = torch.randn(3, 256)
    torch.testing.assert_close(theirs.matmul(x), ours.matmul(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_rows_give_no_rows(kernel: Q4Kernel, dtype: torch.dtype) -> None:
    """An empty batch (a speculative step with nothing to draft) is no error: its tensors'
    data pointers may be NULL."""
    matrix = Q4Matrix.quantize(torch.randn(48, 64), kernel)
    x = torch.empty(0, 64, dtype=dtype)
    assert matrix.matmul(x).shape == (0, 48)
    assert matrix.matmul_plus(x, torch.empty(0, 48, dtype=dtype)).shape == (0, 48)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("rows", "n", "k"), [(3, 50, 128), (9, 2050, 64), (9, 48, 2048)])
def test_each_thread_rounds_and_adds_its_own_columns(kernel: Q4Kernel, threads: int, rows: int, n: int,
                                                     k: int) -> None:
    """bf16 rows are widened as they are quantized and each thread rounds its own tiles'
    columns (and adds the residual to them) after its products: the bits of a product in
    fp32 rounded after, over a partial last tile (50 columns), threads with no whole tiles,
    and scratch too large for the stack (9 x 2,050 products, 9 x 2,048 activations)."""
    generator = torch.Generator().manual_seed(rows * n + k)
    matrix = Q4Matrix.quantize(torch.randn(n, k, generator=generator) / 8, kernel)
    x = torch.randn(rows, k, generator=generator)
    residual = torch.randn(rows, n, generator=generator) * 4
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        products = matrix.matmul(x.bfloat16().float())
        assert torch.equal(matrix.matmul(x.bfloat16()), products.bfloat16())
        assert torch.equal(matrix.matmul_plus(x.bfloat16(), residual.bfloat16()),
                           residual.bfloat16() + products.bfloat16())
        assert torch.equal(matrix.matmul_plus(x, residual), residual + matrix.matmul(x))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_residual_is_added_as_torch_would_add_it(kernel: Q4Kernel, dtype: torch.dtype, rows: int) -> None:
    """`matmul_plus` is o_proj / down_proj with the residual stream: the same bits as
    `residual + matmul(x)` (in bf16, the product rounded first, then the sum)."""
    generator = torch.Generator().manual_seed(rows)
    matrix = Q4Matrix.quantize(torch.randn(96, 128, generator=generator) / 8, kernel)
    x = torch.randn(rows, 128, generator=generator).to(dtype)
    residual = (torch.randn(rows, 96, generator=generator) * 4).to(dtype)
    got = matrix.matmul_plus(x, residual)
    assert got is not None and got.dtype == dtype
    assert torch.equal(got, residual + matrix.matmul(x))
    assert matrix.matmul_plus(x, residual.half()) is None  # mixed dtypes: the caller adds


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_8_bit_gemm_is_int16_activations_times_the_dequantized_matrix(kernel: Q4Kernel, rows: int) -> None:
    generator = torch.Generator().manual_seed(rows + 50)
    weight = torch.randn(80, 192, generator=generator) / 8
    matrix = Q8Matrix.quantize(weight, kernel)
    assert matrix.nibbles.shape == (80, 192) and matrix.in_features == 192 and matrix.bits == 8
    signed = matrix.nibbles.view(torch.int8)
    assert int(signed.max()) == 127 and int(signed.min()) == -127  # each group reaches +-127 steps
    assert matrix.mins is None and matrix.nbytes == 80 * 192 + 80 * 6 * 2  # levels and scales only
    dense = matrix.dequantize()
    step = matrix.scales.float().repeat_interleave(GROUP, dim=1)
    assert ((dense - weight).abs() <= step / 2 + 1e-6).all()
    x = torch.randn(rows, 192, generator=generator)
    # symmetric: every product through the int16 activations, no exact-x minimum's term
    expected = _int16_groups(x) @ dense.T
    torch.testing.assert_close(matrix.matmul(x), expected, rtol=1e-4, atol=1e-4)
    bf16 = x.bfloat16()
    assert torch.equal(matrix.matmul(bf16), matrix.matmul(bf16.float()).bfloat16())
    residual = torch.randn(rows, 80, generator=generator)
    assert torch.equal(matrix.matmul_plus(x, residual), residual + matrix.matmul(x))


def test_a_q8_0_tensor_comes_back_exactly(kernel: Q4Kernel) -> None:
    """GGUF Q8_0: int8 levels times an fp16 scale per 32, every group reaching +-127."""
    generator = torch.Generator().manual_seed(9)
    levels = torch.randint(-127, 128, (16, 128), generator=generator).float()
    levels[:, 0::32] = 127
    scale = (torch.rand(16, 4, generator=generator) / 100).half().float().repeat_interleave(32, dim=1)
    weight = levels * scale
    assert torch.equal(Q8Matrix.quantize(weight, kernel).dequantize(), weight)


def _q5_levels(matrix: Q5Matrix) -> torch.Tensor:
    """The stored 5-bit levels (0..31) of each input, read straight from the layout: input j
    of a 64-block in byte j % 32's low (j < 32) or high nibble, its fifth bit in bit j of the
    block's trailing 8 bytes."""
    blocks = matrix.nibbles.reshape(matrix.out_features, -1, 40).to(torch.int64)
    levels = torch.empty(matrix.out_features, blocks.shape[1], 64, dtype=torch.int64)
    for j in range(64):
        nibble = blocks[..., j % 32] >> (4 * (j // 32)) & 0x0F
        levels[..., j] = nibble | ((blocks[..., 32 + j // 8] >> (j % 8)) & 1) << 4
    return levels.reshape(matrix.out_features, matrix.in_features)


def _q5_with_minimums(matrix: Q5Matrix) -> Q5Matrix:
    """The same weights read as unsigned levels 0..31 plus a minimum of -16 x scale."""
    mins = (matrix.scales.float() * -16).half()
    return Q5Matrix(matrix.nibbles, matrix.scales, mins, matrix.kernel)


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("shape", [(50, 128), (96, 896)])  # 50: a partial tile
def test_5_bit_gemm_is_int16_activations_times_the_dequantized_matrix(kernel: Q4Kernel, rows: int, shape) -> None:
    generator = torch.Generator().manual_seed(rows + 70 + shape[1])
    weight = torch.randn(shape, generator=generator) / 8
    matrix = Q5Matrix.quantize(weight, kernel)
    n, k = shape
    assert matrix.nibbles.shape == (n, k * 5 // 8) and matrix.in_features == k and matrix.bits == 5
    assert matrix.mins is None and matrix.nbytes == n * k * 5 // 8 + n * k // GROUP * 2
    levels = _q5_levels(matrix)
    assert int(levels.min()) == 0 and int(levels.max()) == 31
    dense = matrix.dequantize()
    step = matrix.scales.float().abs().repeat_interleave(GROUP, dim=1)
    assert torch.equal(dense, (levels - 16).float() * matrix.scales.float().repeat_interleave(GROUP, dim=1))
    # the nearest level inside the grid; the ends take what lies beyond them
    interior = (levels > 0) & (levels < 31)
    assert ((dense - weight).abs()[interior] <= step[interior] / 2 + 1e-6).all()
    assert (dense - weight).norm() / weight.norm() < 0.05
    x = torch.randn(rows, k, generator=generator)
    expected = _int16_groups(x) @ dense.T  # symmetric: no exact-x minimum's term
    torch.testing.assert_close(matrix.matmul(x), expected, rtol=1e-4, atol=1e-4)
    bf16 = x.bfloat16()
    assert torch.equal(matrix.matmul(bf16), matrix.matmul(bf16.float()).bfloat16())
    residual = torch.randn(rows, n, generator=generator)
    assert torch.equal(matrix.matmul_plus(x, residual), residual + matrix.matmul(x))
    # With minimums the levels are read unsigned, the minimum's term over the exact x.
    unsigned = _q5_with_minimums(matrix)
    mins = unsigned.mins.float()
    expected = _int16_groups(x) @ (levels.float() * matrix.scales.float().repeat_interleave(GROUP, dim=1)).T
    expected += x.reshape(rows, -1, GROUP).sum(-1) @ mins.T
    torch.testing.assert_close(unsigned.matmul(x), expected, rtol=1e-4, atol=1e-4)


def test_a_q5_0_tensor_comes_back_exactly(kernel: Q4Kernel) -> None:
    """GGUF Q5_0: levels -16..15 times an fp16 scale per 32, whose sign puts the group's
    largest weight on -16 (llama.cpp's scale = that weight / -16)."""
    generator = torch.Generator().manual_seed(11)
    levels = torch.randint(-15, 16, (16, 128), generator=generator).float()
    levels[:, 5::32] = -16
    scale = (torch.rand(16, 4, generator=generator) / 100).half().float()
    scale[::2] *= -1  # a positive largest weight: a negative scale
    weight = levels * scale.repeat_interleave(32, dim=1)
    matrix = Q5Matrix.quantize(weight, kernel)
    assert torch.equal(matrix.dequantize(), weight) and torch.equal(matrix.scales.float(), scale)
    # ...where the 8-bit copy misses Q5_0's grid
    assert not torch.equal(Q8Matrix.quantize(weight, kernel).dequantize(), weight)


def test_5_bit_refit_brings_a_group_closer(kernel: Q4Kernel) -> None:
    """The least-squares refit of each scale: a Q5_0 tensor rounded to bf16 since comes back
    closer than its largest weight's scale alone would bring it."""
    generator = torch.Generator().manual_seed(12)
    levels = torch.randint(-15, 16, (64, 256), generator=generator).float()
    levels[:, 7::32] = -16
    scale = (torch.rand(64, 8, generator=generator) / 100 + 1e-3).half().float().repeat_interleave(32, dim=1)
    original = levels * scale
    rounded = original.bfloat16().float()
    refit = Q5Matrix.quantize(rounded, kernel).dequantize()
    groups = rounded.reshape(64, 8, 32)
    guess_scale = (groups.gather(-1, groups.abs().argmax(-1, keepdim=True)) / -16).half().float()
    first_guess = ((groups / guess_scale).round().clamp(-16, 15) * guess_scale).reshape(64, 256)
    assert (refit - original).norm() < (first_guess - original).norm()
    assert (refit - rounded).norm() <= (first_guess - rounded).norm()


# --- symmetric levels with bf16 scales (compressed-tensors INT4), and the grouped MoE call ---

def _symmetric(out_features: int, in_features: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel nibbles [N, K/2], bf16 scales [N, K/32]) of random signed levels."""
    from tandem.layers.int4_experts import kernel_nibbles

    levels = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scales = (torch.rand(out_features, in_features // GROUP, generator=generator) * 0.02 + 1e-3).bfloat16()
    return kernel_nibbles(levels), scales


def _dense(nibbles: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    from tandem.layers.int4_experts import kernel_levels

    return (kernel_levels(nibbles).float() - 8) * scales.float().repeat_interleave(GROUP, dim=1)


@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("shape", [(66, 64), (256, 7168), (7168, 256)])  # tiny; K2.5's w13 and w2 under TP 8
def test_symmetric_bf16_scaled_gemm_is_int16_activations_times_the_signed_levels(kernel: Q4Kernel, rows: int,
                                                                                 shape) -> None:
    generator = torch.Generator().manual_seed(rows + shape[0])
    nibbles, scales = _symmetric(*shape, generator)
    x = torch.randn(rows, shape[1], generator=generator)
    dense = _dense(nibbles, scales)
    got = kernel.gemm_scaled(nibbles, scales, None, x)
    # no minimum's term: the only rounding is the activations' 16 bits
    torch.testing.assert_close(got, _int16_groups(x) @ dense.T, rtol=1e-4, atol=1e-4)
    exact = x @ dense.T
    assert (got - exact).abs().max() <= 2e-4 * exact.abs().max()
    # fp16 scales and explicit minimums of -8 * scale are the same matrix
    half, mins = scales.half(), (scales.float() * -8).half()
    torch.testing.assert_close(kernel.gemm_scaled(nibbles, half, mins, x), exact, rtol=2e-3, atol=2e-3)


def _stack(experts: int, hidden: int, inter: int, generator: torch.Generator):
    from tandem.kernels.q4_gemm import Q4ExpertStack

    w13, s13 = zip(*(_symmetric(2 * inter, hidden, generator) for _ in range(experts)), strict=True)
    w2, s2 = zip(*(_symmetric(hidden, inter, generator) for _ in range(experts)), strict=True)
    stack = Q4ExpertStack(torch.stack(w13), torch.stack(s13), torch.stack(w2), torch.stack(s2))
    stack.check()
    return stack


def _experts_reference(stack, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out, start = torch.zeros(x.shape[0], stack.hidden), 0
    for e, count in enumerate(counts):
        part = x[start : start + count]
        gate, up = (part @ _dense(stack.w13[e], stack.s13[e]).T).split(stack.inter, dim=-1)
        out[start : start + count] = (torch.nn.functional.silu(gate) * up) @ _dense(stack.w2[e], stack.s2[e]).T
        start += count
    return out


@pytest.mark.parametrize("hidden, inter, counts", [
    (64, 128, [2, 0, 1, 5, 0, 0, 3, 1]),  # the tiny K2.5 model: empty experts, more rows than a pass takes
    (64, 64, [1, 1, 0, 9]),  # its share under TP 2
    (7168, 256, [1, 0, 2, 0]),  # K2.5 under TP 8: 256 of each expert's 2048
    (7168, 2048, [1, 0, 0]),  # K2.5 under EP 8: whole experts
], ids=["tiny", "tiny-tp2", "k25-tp8", "k25-ep8"])
def test_grouped_moe_equals_each_expert_s_swiglu(kernel: Q4Kernel, hidden: int, inter: int, counts: list[int]) -> None:
    generator = torch.Generator().manual_seed(hidden + inter)
    stack = _stack(len(counts), hidden, inter, generator)
    x = torch.randn(sum(counts), hidden, generator=generator)
    offsets = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    got = kernel.moe(stack, x, offsets)
    expected = _experts_reference(stack, x, counts)
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 1e-3 * scale, float((got - expected).abs().max() / scale)


def test_grouped_moe_takes_no_rows(kernel: Q4Kernel) -> None:
    stack = _stack(3, 64, 64, torch.Generator().manual_seed(0))
    assert kernel.moe(stack, torch.empty(0, 64), torch.zeros(4, dtype=torch.int64)).shape == (0, 64)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize("march, isa", [("x86-64", "portable C"), ("haswell", "avx2"),
                                        ("icelake-server", "avx512-vnni")])
def test_every_instruction_set_path_computes_the_same_symmetric_experts(kernel: Q4Kernel, tmp_path: Path, march: str,
                                                                        isa: str) -> None:
    """The symmetric and grouped paths, built for each instruction set this CPU can run (an
    AVX2-only CPU cannot run the AVX-512 build: it is compiled, not run, there)."""
    library = _built_for(march, tmp_path)
    if isa == "avx512-vnni" and kernel.isa != "avx512-vnni":
        return  # built (the source compiles for it); this CPU cannot run it
    other = Q4Kernel(library)
    assert other.isa == isa
    generator = torch.Generator().manual_seed(3)
    stack = _stack(4, 128, 192, generator)
    counts = [3, 0, 5, 1]
    x = torch.randn(9, 128, generator=generator)
    offsets = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    torch.testing.assert_close(other.moe(stack, x, offsets), kernel.moe(stack, x, offsets), rtol=1e-5, atol=1e-5)
    nibbles, scales = stack.w13[2], stack.s13[2]
    torch.testing.assert_close(other.gemm_scaled(nibbles, scales, None, x), kernel.gemm_scaled(nibbles, scales, None, x),
                               rtol=1e-5, atol=1e-5)
