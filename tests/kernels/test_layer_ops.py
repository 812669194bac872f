"""The C passes for norms, rotary and silu-and-mul against the torch ops they replace."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from tandem.config import RopeConfig
from tandem.kernels.layer_ops import SOURCE as LAYER_OPS_SOURCE
from tandem.kernels.layer_ops import LayerOpsKernel
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> LayerOpsKernel:
    return LayerOpsKernel.build(tmp_path_factory.mktemp("cache"))


# 1 and 5 tokens run on the calling thread, 40 over the OpenMP threads.
TOKENS = [1, 5, 40]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# a head size of 40: each half 16 lanes and a 4-value tail
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 128), (3, 1, 40)])
def test_rotary_in_place_is_bit_identical_to_the_torch_ops(ops, tokens, dtype, heads, kv_heads, dim) -> None:
    """On q and k as views into the fused projection (token stride covers v too), so the
    exact fp32 mode keeps its parity with transformers and bf16 gives the same tokens."""
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), dim, 4096, dtype)
    generator = torch.Generator().manual_seed(tokens * dim)
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    angles = rotary.angles(positions)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator) * 4).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    expected = rotary(angles, qk)
    assert ops.takes_rotary(qk, angles[0])
    rotary.ops = ops
    got = rotary.rotate_(angles, qk)
    assert got.data_ptr() == qk.data_ptr()  # in place
    assert torch.equal(got, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v untouched


def test_rotary_falls_back_where_heads_are_not_dense(ops) -> None:
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), 32, 64, torch.float32)
    rotary.ops = ops
    angles = rotary.angles(torch.arange(3))
    x = torch.randn(3, 4, 64)[..., :32]  # each head a slice of a wider row
    assert not ops.takes_rotary(x, angles[0])
    before = x.clone()
    assert torch.equal(rotary.rotate_(angles, x), rotary(angles, before))
    assert torch.equal(x, before)  # not rotated in place


@pytest.mark.parametrize("tokens", TOKENS)
# 576: 32-value vectors alone; 584: an 8-value tail; 632: one more 32-value vector for the
# squares' second chain to skip, then a 16-value vector and an 8-value tail
@pytest.mark.parametrize("hidden", [576, 584, 632])
def test_bf16_rms_norm_matches_transformers_formula(ops, tokens, hidden) -> None:
    """Within one bf16 unit in the last place (the mean is summed in another order), and
    equal on almost every element; rows read through a stride."""
    generator = torch.Generator().manual_seed(tokens)
    norm = RMSNorm(hidden, 1e-5).to(torch.bfloat16)
    norm.weight.data = (torch.rand(hidden, generator=generator) + 0.5).bfloat16()
    wide = (torch.randn(tokens, 2 * hidden, generator=generator) * 3).bfloat16()
    x = wide[:, :hidden]
    expected = norm(x)  # no ops attached: the torch formula
    norm.ops = ops
    got = norm(x)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, hidden)
    ulp = expected.float().abs() * 2**-7
    assert ((got.float() - expected.float()).abs() <= ulp).all()
    assert (got == expected).float().mean() > 0.99


@pytest.mark.parametrize("tokens", TOKENS)
def test_fp32_rms_norm_is_torch_fused_op_to_the_last_place(ops, tokens) -> None:
    """fp32 rows take the C pass too (torch's F.rms_norm on CPU is several passes over the
    rows: 3% of an exact-mode prefill); its mean is summed in another order, so an element
    may move by a few units in the last place, never more."""
    generator = torch.Generator().manual_seed(tokens + 3)
    norm = RMSNorm(576, 1e-6)
    norm.weight.data = torch.rand(576, generator=generator) + 0.5
    wide = torch.randn(tokens, 1152, generator=generator) * 3
    x = wide[:, :576]
    expected = F.rms_norm(x, (576,), norm.weight, 1e-6)
    norm.ops = ops
    assert ops.takes_norm(x, norm.weight)
    got = norm(x)
    assert got.dtype == torch.float32 and got.shape == (tokens, 576)
    assert torch.equal(got, ops.rms_norm(x, norm.weight, 1e-6))  # the module took the C pass
    ulp = expected.abs() * 2**-23
    assert ((got - expected).abs() <= 4 * ulp).all()


@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_mul(ops, tokens) -> None:
    generator = torch.Generator().manual_seed(tokens + 7)
    gate_up = torch.randn(tokens, 2 * 1536, generator=generator) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps
    gate, up = gate_up.split(1536, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=1e-6)
    bf16 = gate_up.bfloat16()
    gate, up = bf16.split(1536, dim=-1)
    got, expected = ops.silu_mul(bf16), F.silu(gate) * up
    assert got.dtype == torch.bfloat16
    ulp = expected.float().abs() * 2**-7
    assert ((got.float() - expected.float()).abs() <= ulp).all()
    assert (got == expected).float().mean() > 0.999


@pytest.mark.parametrize("tokens", TOKENS)
def test_fp32_norm_for_the_decode_stack_is_torchs_to_rounding(ops: LayerOpsKernel, tokens: int) -> None:
    """The fp32 stack's norm (called from C through its entry) against torch's fused fp32
    norm: the mean of squares is summed in another order, so a few fp32 ulps apart."""
    generator = torch.Generator().manual_seed(tokens)
    rows = torch.randn(tokens, 600, generator=generator) * 3
    x = rows[:, :576]  # rows 600 apart, as a strided view
    weight = torch.randn(576, generator=generator)
    out = torch.empty(tokens, 576)
    ops.rms_norm_entry(torch.float32)(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), tokens, 576, 1e-5, torch.get_num_threads())
    torch.testing.assert_close(out, F.rms_norm(x, (576,), weight, 1e-5), rtol=2e-6, atol=2e-6)


def test_argmax_is_torchs_first_maximum_nan_and_all(ops) -> None:
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(7, 1000, generator=generator)  # 1000: a tail of 8 past the last 16
    x[1, 10] = x[1, 900] = 50.0  # a tie: the first
    x[2, 999] = 60.0  # the maximum in the tail
    x[3, 400] = float("nan")  # a NaN wins, as in torch
    x[3, 401] = float("inf")
    x[4] = float("-inf")  # nothing above -inf: index 0
    x[5, 3] = float("inf")
    assert ops.takes_argmax(x) and not ops.takes_argmax(x.half()) and not ops.takes_argmax(x.t())
    torch.testing.assert_close(ops.argmax(x), x.argmax(dim=-1), rtol=0, atol=0)
    assert ops.argmax(x).tolist()[:6] == [int(x[0].argmax()), 10, 999, 400, 0, 3]
    wide = torch.randn(64, 49152, generator=generator)[:, :49000]  # strided rows, many threads' worth
    assert torch.equal(ops.argmax(wide), wide.argmax(dim=-1))
    assert torch.equal(ops.argmax(x[:1]), x[:1].argmax(dim=-1))  # one row: no thread region


def test_a_bf16_row_s_argmax_is_its_fp32_copy_s(ops) -> None:
    """The greedy step of a bf16 LM head takes the argmax of its bf16 logits, skipping the fp32
    copy: widening is exact, so ties (which bf16 makes common), NaNs, infinities and a row's
    tail give the same index as torch's argmax of the copy."""
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(7, 1000, generator=generator).bfloat16()
    x[1, 10] = x[1, 900] = 50.0
    x[1, 11] = 50.1  # bf16 rounds it to 50.0: a three-way tie, the first wins
    x[2, 999] = 60.0
    x[3, 400] = float("nan")
    x[3, 401] = float("inf")
    x[4] = float("-inf")
    x[5, 3] = float("inf")
    x[6, 995] = float("nan")  # a NaN in the tail past the last 16
    assert ops.takes_argmax(x)
    assert ops.argmax(x).tolist() == x.float().argmax(dim=-1).tolist()
    assert ops.argmax(x).tolist()[1:7] == [10, 999, 400, 0, 3, 995]
    wide = torch.randn(64, 49152, generator=generator).bfloat16()[:, :49000]
    assert torch.equal(ops.argmax(wide), wide.float().argmax(dim=-1))
    assert torch.equal(ops.argmax(x[:1]), x[:1].float().argmax(dim=-1))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_the_plain_c_argmax_matches_torch_s(tmp_path) -> None:
    """The argmax's plain loops (a CPU without AVX-512), built for an older target: fp32 and
    bf16 rows with ties, NaNs and infinities give torch's index."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    library = tmp_path / "layer-ops-x86-64.so"
    subprocess.run([compiler, "-O3", "-march=x86-64", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-shared",
                    "-fPIC", "-std=c11", str(LAYER_OPS_SOURCE), "-o", str(library), "-lm"], check=True,
                   capture_output=True)
    plain = LayerOpsKernel(library)
    generator = torch.Generator().manual_seed(10)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(6, 300, generator=generator).to(dtype)
        x[1, 10] = x[1, 200] = 50.0
        x[2, 30] = float("nan")
        x[2, 31] = float("inf")
        x[3] = float("-inf")
        x[4, 299] = 70.0
        assert plain.argmax(x).tolist() == x.float().argmax(dim=-1).tolist()
        assert plain.argmax(x).tolist()[1:5] == [10, 30, 0, 299]
