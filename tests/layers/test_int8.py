"""8-bit weights and activations (W8A8) for large steps: the arithmetic, and where it applies."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.int8_gemm import Int8GemmKernel, load_int8_gemm_kernel
from tandem.kernels.int8_rows import Int8RowsKernel
from tandem.layers.int8 import Int8Weight, gated_mlp, int8_fits, quantize_rows_with_outliers
from tandem.layers.linear import (
    GateUpLinear,
    Linear,
    SmallStepWeights,
    pack_weights_for_cpu,
    quantize_int8,
)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Int8RowsKernel:
    return Int8RowsKernel.build(tmp_path_factory.mktemp("cache"))


def _exact(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """What the mode computes, in float: the quantized rows, their outliers exact, times the
    quantized matrix."""
    rows = quantize_rows_with_outliers(x, weight.outliers)
    approximated = (rows.values.double() * rows.scales.double()).scatter(
        1, rows.outlier_index.long(), rows.outlier_value.double())
    return approximated @ weight.dequantize().double().t()


@pytest.mark.parametrize("use_kernel", [False, True])
def test_matmul_is_quantized_rows_times_the_quantized_matrix(kernel, use_kernel) -> None:
    generator = torch.Generator().manual_seed(1)
    matrix = torch.randn(96, 64, generator=generator) / 8
    weight = Int8Weight.quantize(matrix, kernel if use_kernel else None)
    x = torch.randn(33, 64, generator=generator)
    x[:, 9] *= 50  # an outlier channel
    got = weight.matmul(x)
    torch.testing.assert_close(got.double(), _exact(x, weight), rtol=1e-5, atol=1e-5)
    dense = x @ matrix.t()
    error = (got - dense).norm() / dense.norm()
    assert error < 0.01  # and close to the dense product
    # the outlier channel set aside is what keeps it close: without, the scale is 50x coarser
    plain = Int8Weight.quantize(matrix, kernel if use_kernel else None, outliers=0)
    assert (plain.matmul(x) - dense).norm() / dense.norm() > 3 * error


def test_a_row_gets_the_same_result_alone_as_in_a_batch(kernel) -> None:
    """Each row is quantized with its own scale: a one-token step computes what the same token
    gets inside a prefill chunk (what lets a one-token-per-step perplexity measure the mode)."""
    generator = torch.Generator().manual_seed(2)
    weight = Int8Weight.quantize(torch.randn(64, 128, generator=generator), kernel)
    x = torch.randn(40, 128, generator=generator) * torch.logspace(-2, 2, 40).unsqueeze(1)
    batch = weight.matmul(x)
    for row in (0, 17, 39):
        assert torch.equal(weight.matmul(x[row : row + 1]), batch[row : row + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_and_torch_paths_agree_with_bias_and_residual(kernel, dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    matrix = torch.randn(64, 96, generator=generator) / 8
    bias = torch.randn(64, generator=generator).to(dtype)
    x = torch.randn(20, 96, generator=generator).to(dtype)
    residual = torch.randn(20, 64, generator=generator).to(dtype)
    fast = Int8Weight.quantize(matrix, kernel).matmul(x, bias, residual)
    plain = Int8Weight.quantize(matrix).matmul(x, bias, residual)
    assert fast.dtype == plain.dtype == dtype
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(fast, plain, **tolerance)


def test_shapes_int8_takes() -> None:
    assert int8_fits(torch.zeros(16, 64))
    assert not int8_fits(torch.zeros(12, 64))
    assert not int8_fits(torch.zeros(16, 60))
    with pytest.raises(ValueError, match="multiples of 8"):
        Int8Weight.quantize(torch.zeros(12, 64))


def test_large_steps_read_int8_small_steps_their_copy(kernel) -> None:
    torch.manual_seed(4)
    model = torch.nn.ModuleDict({"proj": Linear(64, 32, bias=True), "mlp": GateUpLinear(64, 48)})
    for layer in model.values():
        layer.weight.data.normal_(0, 0.1)
    model["proj"].bias.data.normal_()
    dense = model["proj"].weight.detach().clone()
    gate, up = model["mlp"].weight.detach().clone().split(48)
    model["proj"].attach_small_step_weights(SmallStepWeights(2, "float16"))
    assert quantize_int8(model, kernel) == 2  # the gate/up too, now that outliers are kept exact
    pack_weights_for_cpu(model)
    x = torch.randn(8, 64)
    want = torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())
    assert model["mlp"].packed_halves is None and model["mlp"].weight.numel() == 0
    assert (model["mlp"](x) - want).norm() / want.norm() < 0.02
    assert model["proj"].weight.numel() == 0  # the dense copy is released
    proj = model["proj"]
    x = torch.randn(8, 64)
    torch.testing.assert_close(proj(x), proj.int8.matmul(x, proj.bias))
    small = x[:2]
    torch.testing.assert_close(proj(small), (small.half() @ dense.half().t() + proj.bias.half()).float(),
                               rtol=1e-3, atol=1e-3)
    residual = torch.randn(8, 32)
    torch.testing.assert_close(proj(x, residual), proj.int8.matmul(x, proj.bias, residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_8_bit_lm_head_writes_fp32_logits_from_its_products(kernel, dtype) -> None:
    """The head is quantized with the projections; its logits come out in fp32 straight from
    the dequantize pass (no narrowing to the run dtype on the way), while a step small enough
    for the decode copy still reads that copy."""
    from tandem.layers.embedding import LMHead

    torch.manual_seed(5)
    head = LMHead(96, 64)
    head.weight.data.normal_(0, 0.1)
    dense = head.weight.detach().clone()
    head.attach_small_step_weights(SmallStepWeights(2, "float16"))
    assert quantize_int8(torch.nn.ModuleDict({"head": head}), kernel) == 1
    x = torch.randn(6, 64).to(dtype)
    logits = head(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, head.int8.matmul(x, dtype=torch.float32))
    want = _exact(x.float(), head.int8).float()
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert (logits - x.float() @ dense.t()).norm() / logits.norm() < 0.02
    small = x[:1]  # the fp16 copy's product, in the run dtype
    torch.testing.assert_close(head(small), (small.half() @ dense.half().t()).to(dtype).float())


def test_an_8_bit_mlp_fuses_the_passes_between_its_projections(kernel) -> None:
    """With both projections in 8 bits, a large step's MLP runs dequantize, silu-and-mul and
    quantize as one pass (gated_down), with what the projections one by one give; a step small
    enough for the decode copies takes the unfused path."""
    from tandem.layers.linear import RowParallelLinear
    from tandem.models.llama import DecoderMLP

    torch.manual_seed(6)
    mlp = DecoderMLP.__new__(DecoderMLP)
    torch.nn.Module.__init__(mlp)
    mlp.gate_up_proj, mlp.down_proj = GateUpLinear(64, 80), RowParallelLinear(80, 64)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.weight.data.normal_(0, 0.1)
        layer.attach_small_step_weights(SmallStepWeights(2, "float16"))
    mlp = mlp.bfloat16()
    assert quantize_int8(mlp, kernel) == 2
    x, residual = torch.randn(8, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    fused = mlp.gate_up_proj.gated_down(mlp.down_proj, x, residual)
    if kernel.isa != "avx512":
        assert fused is None
        return
    assert fused is not None
    one_by_one = mlp.down_proj(mlp.gate_up_proj(x), residual)
    torch.testing.assert_close(fused, one_by_one, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(mlp(x, residual), fused)
    assert mlp.gate_up_proj.gated_down(mlp.down_proj, x[:2], residual[:2]) is None  # the decode copies' step


@pytest.fixture(scope="module")
def gemm(tmp_path_factory: pytest.TempPathFactory) -> Int8GemmKernel:
    kernel = load_int8_gemm_kernel(tmp_path_factory.mktemp("gemm"))
    if kernel is None:
        pytest.skip("no packed int8 GEMM on this CPU (it needs AVX-512-VNNI)")
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_matrix_computes_the_columns_bits(kernel, gemm, dtype) -> None:
    """The packed GEMM against torch._int_mm on the [in, out] columns: the same integers, so
    the very same outputs, with outliers, a bias, a residual, fp32 logits, rows torch's path
    takes (fp16: the C passes do not) and the fused MLP middle."""
    generator = torch.Generator().manual_seed(8)
    matrix = torch.randn(160, 96, generator=generator) / 8
    packed = Int8Weight.quantize(matrix, kernel, gemm=gemm)
    columns = Int8Weight.quantize(matrix, kernel)
    assert packed.packed is not None and columns.packed is None
    assert torch.equal(packed.packed.columns(), columns.columns)
    assert packed.nbytes == columns.nbytes + 160 * 96 + 160 * 4  # + the blocks and their compensation
    x = torch.randn(70, 96, generator=generator).to(dtype)
    x[:, [3, 50]] *= 40  # outlier channels, at k % 4 = 3 and 2
    bias = torch.randn(160, generator=generator).to(dtype)
    residual = torch.randn(70, 160, generator=generator).to(dtype)
    assert torch.equal(packed.matmul(x, bias, residual), columns.matmul(x, bias, residual))
    assert torch.equal(packed.matmul(x, dtype=torch.float32), columns.matmul(x, dtype=torch.float32))
    half = x.half()
    assert torch.equal(packed.matmul(half, bias.half()), columns.matmul(half, bias.half()))
    down = torch.randn(96, 80, generator=generator) / 8
    pairs = Int8Weight.quantize(matrix, kernel, gemm=gemm, gate_up=True)  # 80 gate rows, then 80 up
    assert pairs.gate_up_pairs == (kernel.isa == "avx512") and torch.equal(pairs.columns, columns.columns)
    # a pairs matrix's plain product comes from its columns, not its interleaved blocks
    assert torch.equal(pairs.matmul(x, bias, residual), columns.matmul(x, bias, residual))
    fused = [gated_mlp(w, Int8Weight.quantize(down, kernel, gemm=g), x, x)
             for w, g in ((packed, gemm), (columns, None), (pairs, gemm))]
    if kernel.isa == "avx512":
        assert torch.equal(fused[0], fused[1]) and torch.equal(fused[2], fused[1])


def test_a_shape_the_packed_gemm_cannot_take_keeps_columns(kernel, gemm) -> None:
    assert Int8Weight.quantize(torch.randn(40, 64), kernel, gemm=gemm).packed is None  # 40: not a multiple of 16
    assert Int8Weight.quantize(torch.randn(48, 64), None, gemm=gemm).packed is None  # no C passes to read it


@pytest.mark.parametrize("shape", [(64, 576, 1536), (3, 5000, 40), (17, 1024, 8)])
def test_the_fp32_sliced_integer_gemm_is_torchs_bit_for_bit(monkeypatch: pytest.MonkeyPatch, shape) -> None:
    """Where torch's int8 GEMM is a scalar loop (AVX2), K-slices of fp32 GEMMs stand in: with
    every value at the int8 extremes, each slice's partial sums must still be exact."""
    import tandem.layers.int8 as int8

    m, k, n = shape
    torch.manual_seed(0)
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    a[0], b[0] = -128, -128  # one product at the largest sum the slices allow: 1024 * 2**14
    a[1], b[1] = 127, 125 + 2 * torch.randint(0, 2, (k,))  # odd terms, which fp32 rounds past 2**24
    monkeypatch.setattr(int8, "_native_int_mm", lambda: False)
    assert torch.equal(int8.int_mm(a, b.t()), torch._int_mm(a, b.t()))


def test_the_int8_linear_s_rate_times_its_whole_matmul(kernel: Int8RowsKernel, monkeypatch) -> None:
    """The bench's int8 limit: 2 m k n FLOPs over the time of `Int8Weight.matmul`, the rows'
    quantization included (a warm-up call, then the timed repeats, the fastest of them)."""
    from tandem.layers.int8 import Int8Weight, int8_linear_flops_per_s
    from tandem.platform import machine

    calls = []
    real = Int8Weight.matmul
    monkeypatch.setattr(Int8Weight, "matmul", lambda self, x, *a, **k: calls.append(x.shape) or real(self, x, *a, **k))
    clock = iter([10.0, 13.0, 13.0, 15.0, 15.0, 19.0, 19.0, 20.0])  # calls of 3, 2, 4 and 1 s
    monkeypatch.setattr(machine.time, "perf_counter", lambda: next(clock))
    rate = int8_linear_flops_per_s(64, 128, 256, torch.bfloat16, kernel, None, repeats=4)
    assert calls == [(64, 128)] * 5 and rate == 2 * 64 * 128 * 256 / 1.0
