"""Merged projections, oneDNN-packed weights and the half-precision small-step copies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.layers.linear import (
    GateUpLinear,
    Linear,
    MergedLinear,
    SmallStepWeights,
    attach_small_step_weights,
    onednn_available,
    onednn_bf16_available,
    pack_weights_for_cpu,
)


def _random_pair(bias: bool = True) -> tuple[Linear, Linear]:
    torch.manual_seed(0)
    layer = Linear(64, 32, bias=bias)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    exact = Linear(64, 32, bias=bias)
    exact.load_state_dict(layer.state_dict())
    return layer, exact


def test_merged_linear_loads_shards_into_row_ranges() -> None:
    layer = MergedLinear(4, [3, 2, 2])
    parts = [torch.randn(3, 4), torch.randn(2, 4), torch.randn(2, 4)]
    for index, part in enumerate(parts):
        layer.load("weight", part, shard=index)
    x = torch.randn(5, 4)
    torch.testing.assert_close(layer(x), x @ torch.cat(parts).T)


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("bias", [True, False])
def test_packed_weights_compute_the_same_linear(bias: bool) -> None:
    layer, exact = _random_pair(bias)
    assert pack_weights_for_cpu(layer) == 1
    assert layer.packed_weight is not None and layer.weight.numel() == 0  # dense copy released
    for tokens in (1, 3, 64, 300):
        x = torch.randn(tokens, 64)
        torch.testing.assert_close(layer(x), exact(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_packed_for_tandems_gemm_compute_the_same_linear(tmp_path, dtype) -> None:
    """With tandem's packed GEMM given, a linear, the LM head and a gate/up projection pack for
    it instead of oneDNN (one copy, the dense one released) and compute F.linear's result
    (+ bias, + residual, 3-D input), and silu(gate) * up, to rounding."""
    from tandem.kernels.dense_gemm import load_dense_gemm_kernel

    gemm = load_dense_gemm_kernel(tmp_path)
    if gemm is None or not gemm.multiplies(dtype):
        pytest.skip(f"no packed {dtype} GEMM on this CPU")
    layer, exact = _random_pair()
    layer, exact = layer.to(dtype), exact.to(dtype)
    mlp, mlp_weight, mlp_bias = _gate_up(bias=True)
    mlp = mlp.to(dtype)
    mlp_weight, mlp_bias = mlp.weight.detach().clone(), mlp.bias.detach().clone()
    assert pack_weights_for_cpu(torch.nn.ModuleDict({"proj": layer, "mlp": mlp}), gemm) == 2
    assert layer.dense_packed is not None and layer.packed_weight is None and layer.weight.numel() == 0
    assert mlp.gated_packed is not None and mlp.packed_halves is None and mlp.weight.numel() == 0 and mlp.packed
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for shape in ((1, 64), (70, 64), (2, 9, 64)):
        x = torch.randn(shape).to(dtype)
        residual = torch.randn(*shape[:-1], 32).to(dtype)
        torch.testing.assert_close(layer(x), exact(x), **tolerance)
        torch.testing.assert_close(layer(x, residual), exact(x) + residual, **tolerance)
        gated = _silu_mul(x.double(), mlp_weight.double(), mlp_bias.double()).to(dtype)
        torch.testing.assert_close(mlp(x), gated, **tolerance)


@pytest.mark.parametrize("dtype, tolerance", [("float16", 0.02), ("bfloat16", 0.05)])
def test_small_step_copy_used_only_for_small_steps(dtype: str, tolerance: float) -> None:
    layer, exact = _random_pair()
    added = attach_small_step_weights(layer, SmallStepWeights(max_tokens=4, format=dtype))
    assert added == 64 * 32 * 2

    small, large = torch.randn(4, 64), torch.randn(5, 64)
    assert torch.equal(layer(large), exact(large))  # above the threshold: the fp32 weights
    out = layer(small)
    assert out.dtype == torch.float32
    assert not torch.equal(out, exact(small))
    torch.testing.assert_close(out, exact(small), rtol=tolerance, atol=tolerance * 8)
    layer.small_weight.zero_()  # proves which copy a small step reads
    assert torch.equal(layer(small), torch.zeros_like(out) + layer.small_bias.float())


def _gate_up(bias: bool) -> tuple[GateUpLinear, torch.Tensor, torch.Tensor | None]:
    torch.manual_seed(1)
    layer = GateUpLinear(64, 48, bias=bias)
    weight = torch.randn(96, 64) / 8
    layer.load("weight", weight[:48], shard=0)
    layer.load("weight", weight[48:], shard=1)
    full_bias = None
    if bias:
        full_bias = torch.randn(96)
        layer.load("bias", full_bias[:48], shard=0)
        layer.load("bias", full_bias[48:], shard=1)
    return layer, weight, full_bias


def _silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    gate, up = F.linear(x, weight, bias).split(48, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("bias", [True, False])
def test_gate_up_gives_silu_of_gate_times_up(bias: bool) -> None:
    layer, weight, full_bias = _gate_up(bias)
    x = torch.randn(7, 64)
    torch.testing.assert_close(layer(x), _silu_mul(x, weight, full_bias))
    with pytest.raises(ValueError, match="no residual"):
        layer(x, torch.zeros(7, 48))


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("bias", [True, False])
def test_packed_gate_up_fuses_silu_and_mul_into_the_gemms(bias: bool) -> None:
    layer, weight, full_bias = _gate_up(bias)
    assert pack_weights_for_cpu(layer) == 1
    assert layer.packed_halves is not None and layer.packed_weight is None
    assert layer.weight.numel() == 0  # dense copy released: the packed halves are what runs
    for tokens in (1, 3, 64, 300):
        x = torch.randn(tokens, 64)
        torch.testing.assert_close(layer(x), _silu_mul(x, weight, full_bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [True, False])
def test_a_residual_is_added_to_the_projection(packed: bool) -> None:
    if packed and not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    layer, exact = _random_pair(bias=True)
    if packed:
        pack_weights_for_cpu(layer)
    for tokens in (1, 64):
        x, residual = torch.randn(tokens, 64), torch.randn(tokens, 32)
        torch.testing.assert_close(layer(x, residual), residual + exact(x), rtol=1e-5, atol=1e-5)


def test_small_steps_of_a_packed_gate_up_read_the_half_precision_copy() -> None:
    layer, weight, full_bias = _gate_up(bias=True)
    attach_small_step_weights(layer, SmallStepWeights(max_tokens=2, format="float16"))
    pack_weights_for_cpu(layer)
    small = torch.randn(2, 64)
    out = layer(small)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _silu_mul(small, weight, full_bias), rtol=0.02, atol=0.05)
    layer.small_weight.zero_()  # the small step now sees silu(bias_gate) * bias_up
    expected = F.silu(full_bias[:48].half().float()) * full_bias[48:].half().float()
    torch.testing.assert_close(layer(small), expected.expand(2, 48), rtol=1e-3, atol=1e-3)


def test_int4_small_steps_read_the_4_bit_copy_and_larger_steps_the_dense_weights() -> None:
    layer, exact = _random_pair(bias=True)
    added = attach_small_step_weights(layer, SmallStepWeights(max_tokens=2, format="int4"))
    assert layer.small_quantized is not None
    assert added == 32 * 64 // 2 + (64 // 32) * 32 * 2 * 4  # nibbles + an fp32 (scale, zero) per row and group
    small, large = torch.randn(2, 64), torch.randn(3, 64)
    assert torch.equal(layer(large), exact(large))
    out = layer(small)
    assert out.dtype == torch.float32
    assert not torch.equal(out, exact(small))
    dense = layer.small_quantized.dequantize()
    torch.testing.assert_close(out, small @ dense.T + layer.bias, rtol=1e-4, atol=1e-4)
    layer.small_quantized.scales_and_zeros.zero_()  # proves which copy a small step reads: bias only
    torch.testing.assert_close(layer(small), layer.bias.expand(2, 32))


def test_int4_gives_a_matrix_the_kernel_cannot_take_a_bf16_copy() -> None:
    """Half an fp32 matrix's bytes for small steps where 4 bits cannot go; large steps keep
    the exact weights."""
    torch.manual_seed(0)
    layer = Linear(64, 24)  # 24 output rows: not a multiple of 16
    torch.nn.init.normal_(layer.weight)
    added = attach_small_step_weights(layer, SmallStepWeights(max_tokens=2, format="int4"))
    if not onednn_bf16_available():  # an AVX2-only CPU: no bf16 GEMM, the dense weights stay
        assert added == 0 and layer.small_step is None
        x = torch.randn(1, 64)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
        return
    assert added == 24 * 64 * 2
    assert layer.small_quantized is None and layer.small_packed is not None
    x = torch.randn(1, 64)
    want = torch.nn.functional.linear(x.bfloat16(), layer.weight.bfloat16()).float()
    torch.testing.assert_close(layer(x), want, rtol=0.02, atol=0.05)
    large = torch.randn(3, 64)
    assert torch.equal(layer(large), torch.nn.functional.linear(large, layer.weight))


def test_unknown_small_step_format_is_refused() -> None:
    with pytest.raises(ValueError, match="float16, bfloat16, int4"):
        SmallStepWeights(max_tokens=2, format="int3")


def test_int4_small_steps_use_tandems_4_bit_kernel_where_given(tmp_path) -> None:
    from tandem.kernels.q4_gemm import Q4Kernel, Q4Matrix

    kernel = Q4Kernel.build(tmp_path)
    layer, exact = _random_pair(bias=True)
    attach_small_step_weights(layer, SmallStepWeights(max_tokens=2, format="int4"), kernel)
    assert isinstance(layer.small_quantized, Q4Matrix)
    small = torch.randn(2, 64)
    torch.testing.assert_close(layer(small), layer.small_quantized.matmul(small) + layer.bias)
    dense = layer.small_quantized.dequantize()  # the 4-bit weights, times int8-rounded activations
    torch.testing.assert_close(layer(small), small @ dense.T + layer.bias, rtol=0.01, atol=0.3)
    large = torch.randn(3, 64)
    assert torch.equal(layer(large), exact(large))


def test_int4_max_error_keeps_matrices_that_4_bits_would_change() -> None:
    """The target's int4 mode copies only matrices already on a 4-bit grid (a Q4 GGUF's)."""
    torch.manual_seed(3)
    plan = SmallStepWeights(max_tokens=2, format="int4", int4_max_error=0.01)
    smooth = Linear(64, 32)
    smooth.weight.data.normal_()
    added = attach_small_step_weights(smooth, plan)  # a bf16 copy instead, where oneDNN is
    assert smooth.small_quantized is None and added == (64 * 32 * 2 if onednn_bf16_available() else 0)
    on_grid = Linear(64, 32)
    levels = torch.randint(0, 16, (32, 64)).float()
    levels[:, 0::32], levels[:, 1::32] = 0, 15  # every group spans its range
    on_grid.weight.data.copy_(levels / 16 - 0.5)
    assert attach_small_step_weights(on_grid, plan) > 0 and on_grid.small_quantized is not None


def test_one_and_two_row_gemms_are_padded_to_four_rows_for_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's 1-2 row path is slower than its 4-row one: small inputs go in padded, and
    each output row is still its own input row's."""
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    layer, exact = _random_pair(bias=True)
    pack_weights_for_cpu(layer)
    seen: list[int] = []
    call = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):
        seen.append(x.shape[0])
        return call(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    for tokens in (1, 2, 3, 5):
        x = torch.randn(tokens, 64)
        out = layer(x)
        assert out.shape == (tokens, 32)
        torch.testing.assert_close(out, exact(x), rtol=1e-5, atol=1e-5)
    assert seen == [4, 4, 4, 5]


@pytest.mark.parametrize("rows", [1, 3, 4, 64])
def test_bf16_without_a_bf16_gemm_is_multiplied_in_fp32_and_rounded_once(monkeypatch: pytest.MonkeyPatch,
                                                                         rows: int) -> None:
    """On a CPU whose oneDNN has no bf16 GEMM (AVX2), torch's bf16 GEMM is a slow loop: from 4
    rows the operands are widened and the fp32 product rounded to bf16 once; fewer rows keep
    torch's bf16 call (a GEMV, where widening the weights costs more than it saves)."""
    import tandem.layers.linear as linear

    torch.manual_seed(0)
    x, w, b = torch.randn(rows, 96).bfloat16(), torch.randn(40, 96).bfloat16(), torch.randn(40).bfloat16()
    widened = F.linear(x.float(), w.float(), b.float()).bfloat16()  # before F.linear is recorded
    calls: list[torch.dtype] = []
    plain = F.linear

    def recording(*args: torch.Tensor) -> torch.Tensor:
        calls.append(args[1].dtype)
        return plain(*args)

    monkeypatch.setattr(linear.F, "linear", recording)
    monkeypatch.setattr(linear, "onednn_bf16_available", lambda: False)
    got = linear.dense_linear(x, w, b)
    assert got.dtype == torch.bfloat16 and calls == [torch.float32 if rows >= 4 else torch.bfloat16]
    assert torch.equal(got, widened if rows >= 4 else plain(x, w, b))
    monkeypatch.setattr(linear, "onednn_bf16_available", lambda: True)  # where the GEMM exists, torch's call
    assert torch.equal(linear.dense_linear(x, w, b), plain(x, w, b)) and calls[-1] == torch.bfloat16


@pytest.mark.parametrize("rows", [1, 16])
def test_bf16_einsum_without_a_bf16_gemm_is_multiplied_in_fp32_and_rounded_once(monkeypatch: pytest.MonkeyPatch,
                                                                               rows: int) -> None:
    """MLA's absorbed per-head products (activations [T, heads, n] times [heads, n, latent]):
    widened on a CPU without a bf16 GEMM at any row count, torch's bf16 einsum elsewhere."""
    import tandem.layers.linear as linear

    torch.manual_seed(0)
    x, w = torch.randn(rows, 4, 64).bfloat16(), torch.randn(4, 64, 48).bfloat16()
    widened = torch.einsum("thn,hnl->thl", x.float(), w.float()).bfloat16()
    calls: list[torch.dtype] = []
    plain = torch.einsum

    def recording(equation: str, *operands: torch.Tensor) -> torch.Tensor:
        calls.append(operands[1].dtype)
        return plain(equation, *operands)

    monkeypatch.setattr(torch, "einsum", recording)
    monkeypatch.setattr(linear, "onednn_bf16_available", lambda: False)
    got = linear.dense_einsum("thn,hnl->thl", x, w)
    assert got.dtype == torch.bfloat16 and calls == [torch.float32] and torch.equal(got, widened)
    monkeypatch.setattr(linear, "onednn_bf16_available", lambda: True)
    assert torch.equal(linear.dense_einsum("thn,hnl->thl", x, w), plain("thn,hnl->thl", x, w))
    assert calls[-1] == torch.bfloat16


def test_the_census_counts_each_kind_of_small_step_copy(tmp_path) -> None:
    """What the start-up log reports: a matrix on the 4-bit grid in 4 bits, one on Q5_0's grid
    in 5, a smooth one in 8."""
    from tandem.kernels.q4_gemm import Q4Kernel
    from tandem.layers.linear import small_step_census

    kernel = Q4Kernel.build(tmp_path)
    torch.manual_seed(3)
    plan = SmallStepWeights(max_tokens=2, format="int4", int4_max_error=0.01)
    smooth, on_grid, untouched = Linear(64, 32), Linear(64, 32), Linear(64, 32)
    smooth.weight.data.normal_()
    levels = torch.randint(0, 16, (32, 64)).float()
    levels[:, 0::32], levels[:, 1::32] = 0, 15
    on_grid.weight.data.copy_(levels / 16 - 0.5)
    on_q5_grid = Linear(64, 32)
    q5_levels = torch.randint(-16, 16, (32, 64)).float()
    q5_levels[:, 0::32] = -16  # Q5_0's quantizer puts each group's largest weight on -16
    on_q5_grid.weight.data.copy_(q5_levels * torch.rand(32, 2).half().float().repeat_interleave(32, dim=1) / 100)
    model = torch.nn.ModuleList([smooth, on_grid, on_q5_grid, untouched])
    for layer in (smooth, on_grid, on_q5_grid):
        attach_small_step_weights(layer, plan, kernel)
    assert small_step_census(model) == {"8-bit": 1, "5-bit": 1, "4-bit": 1}


def test_a_fused_matrix_s_small_part_is_judged_on_its_own(tmp_path) -> None:
    """A qkv whose q and k rows are on Q5_0's grid and whose v rows are not (Qwen2.5-Coder's
    Q8_0 v in some layers): 5 bits come within 1% of the whole matrix but not of the v rows,
    so the matrix takes 8 bits."""
    from tandem.kernels.q4_gemm import Q4Kernel, Q5Matrix, Q8Matrix
    from tandem.layers.linear import _relative_error

    kernel = Q4Kernel.build(tmp_path)
    torch.manual_seed(4)
    levels = torch.randint(-16, 16, (960, 128)).float()
    levels[:, 0::32] = -16
    on_grid = levels * torch.rand(960, 4).half().float().repeat_interleave(32, dim=1) / 100
    smooth = torch.randn(64, 128) * float(on_grid.std()) / 2
    fused = Linear(128, 1024)
    fused.weight.data.copy_(torch.cat([on_grid, smooth]))
    whole = Q5Matrix.quantize(fused.weight.data, kernel)
    assert float((whole.dequantize() - fused.weight.data).norm() / fused.weight.data.norm()) < 0.01
    assert _relative_error(whole, fused.weight.data) > 0.01
    attach_small_step_weights(fused, SmallStepWeights(max_tokens=2, format="int4", int4_max_error=0.01), kernel)
    assert isinstance(fused.small_quantized, Q8Matrix)


def test_a_copy_too_far_on_a_sample_of_blocks_is_never_made_whole(tmp_path, monkeypatch) -> None:
    """Start-up tries 4, 5 and 8 bits in turn: a copy is first made of every 8th block of 64
    rows, and one whose sample is already past the bar is not made of the whole matrix."""
    from tandem.kernels.q4_gemm import Q4Kernel, Q4Matrix, Q5Matrix, Q8Matrix

    kernel = Q4Kernel.build(tmp_path)
    made: list[tuple[str, int]] = []
    for scheme in (Q4Matrix, Q5Matrix, Q8Matrix):
        original = scheme.quantize.__func__

        def recording(cls, weight, kernel, original=original):  # noqa: ANN001, ANN202
            made.append((cls.__name__, weight.shape[0]))
            return original(cls, weight, kernel)

        monkeypatch.setattr(scheme, "quantize", classmethod(recording))
    torch.manual_seed(5)
    smooth = Linear(128, 2048)
    smooth.weight.data.normal_()
    attach_small_step_weights(smooth, SmallStepWeights(max_tokens=2, format="int4", int4_max_error=0.01), kernel)
    assert isinstance(smooth.small_quantized, Q8Matrix)
    assert made == [("Q4Matrix", 256), ("Q5Matrix", 256), ("Q8Matrix", 256), ("Q8Matrix", 2048)]


def test_a_step_reads_the_copy_its_size_picks(tmp_path) -> None:
    """`step_read_bytes` (the bench's own limits) follows `linear`'s dispatch: a step within
    the small copy's tokens reads the 4-bit copy, a larger one the dense weights, then the
    packed ones once packed; 8-bit weights where they are, and a gated MLP's packed pairs."""
    from tandem.kernels.dense_gemm import load_dense_gemm_kernel
    from tandem.kernels.int8_gemm import load_int8_gemm_kernel
    from tandem.kernels.int8_rows import Int8RowsKernel
    from tandem.kernels.q4_gemm import Q4Kernel

    torch.manual_seed(3)
    layer = Linear(64, 32)
    levels = torch.randint(0, 16, (32, 64)).float()
    levels[:, 0::32], levels[:, 1::32] = 0, 15
    layer.weight.data.copy_(levels / 16 - 0.5)
    dense = 64 * 32 * 4
    assert layer.step_read_bytes(1) == layer.step_read_bytes(3) == dense
    attach_small_step_weights(layer, SmallStepWeights(max_tokens=2, format="int4"), Q4Kernel.build(tmp_path))
    four_bit = layer.small_quantized.nbytes
    assert 64 * 32 // 2 <= four_bit < dense // 4
    assert layer.step_read_bytes(1) == layer.step_read_bytes(2) == four_bit
    assert layer.step_read_bytes(3) == dense
    if onednn_available():
        pack_weights_for_cpu(torch.nn.ModuleList([layer]))
        assert layer.weight.numel() == 0 and layer.step_read_bytes(3) == dense  # the packed copy
        assert layer.step_read_bytes(1) == four_bit

    eight = Linear(64, 32)
    eight.weight.data.normal_()
    assert eight.quantize_int8(Int8RowsKernel.build(tmp_path), load_int8_gemm_kernel(tmp_path))
    # a byte a weight (padded blocks where packed for the GEMM) and a scale a row; the
    # columns kept beside a packed copy are not read
    assert 64 * 32 + 32 * 4 <= eight.step_read_bytes(3) == eight.int8.read_nbytes < 2 * 64 * 32

    gemm = load_dense_gemm_kernel(tmp_path)
    if gemm is not None:
        gate_up = GateUpLinear(64, 32)
        gate_up.weight.data.normal_()
        gate_up.pack_for_cpu(drop_dense=True, dense_gemm=gemm)
        assert gate_up.gated_packed is not None and gate_up.step_read_bytes(3) == 2 * 32 * 64 * 4
