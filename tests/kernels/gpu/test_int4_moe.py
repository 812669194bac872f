"""The INT4 MoE grouped GEMM (tandem/kernels/gpu/int4_moe.py) in Triton's CPU interpreter,
against a dequantized fp32 reference unpacked here in torch: the tiny model's shapes (empty
experts included), Kimi K2.5's expert shapes under tensor and expert parallelism over 8 GPUs
(few experts, few rows, so the interpreter finishes), split K, the fused silu-and-mul, and the
packing itself against compressed-tensors'. fp16 and fp32 only: the interpreter mangles bf16
loads (bf16 is for a GPU run, `tandem bench gpu --int4-moe` checks it there)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.gpu.int4_moe import (
    dequantize_int4,
    int4_moe_config,
    int4_moe_gemm,
    int4_moe_splits,
    row_tiles,
)
from tandem.kernels.gpu.silu_mul import silu_mul


def pack(q: torch.Tensor) -> torch.Tensor:
    """Signed levels q in [-8, 7], [..., K] -> int32 words [..., K / 8]: input 8w + j in bits
    4j..4j+3 of word w, as q + 8 (compressed-tensors' pack-quantized layout)."""
    levels = (q.to(torch.int64) + 8).view(*q.shape[:-1], q.shape[-1] // 8, 8)
    words = (levels << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack`: int32 words [..., K / 8] -> signed levels [..., K]."""
    levels = (packed.to(torch.int64)[..., None] >> (4 * torch.arange(8))) & 0xF
    return (levels - 8).flatten(-2)


def quantized_experts(experts: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (experts, n, k), generator=generator)
    scales = (torch.rand(experts, n, k // 32, generator=generator) * 0.02 + 0.002).to(dtype)
    return pack(q), scales


def reference(x: torch.Tensor, offsets: list[int], packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32: each expert's rows times its weights, dequantized in torch."""
    weights = unpack(packed).float() * scales.float().repeat_interleave(32, dim=-1)
    out = torch.zeros(x.shape[0], packed.shape[1])
    for e in range(packed.shape[0]):
        out[offsets[e]:offsets[e + 1]] = x[offsets[e]:offsets[e + 1]].float() @ weights[e].T
    return out


def sorted_rows(counts: list[int], k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, list[int]]:
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    x = torch.randn(offsets[-1], k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return x, offsets


TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3}


def check(counts: list[int], n: int, k: int, dtype: torch.dtype, seed: int = 0, **kwargs) -> torch.Tensor:
    packed, scales = quantized_experts(len(counts), n, k, dtype, seed)
    x, offsets = sorted_rows(counts, k, dtype, seed + 1)
    got = int4_moe_gemm(x, torch.tensor(offsets, dtype=torch.int32), packed, scales, **kwargs)
    want = reference(x, offsets, packed, scales)
    assert got.dtype == dtype and got.shape == want.shape
    # fp32 accumulation; the dequantized weight rounded to x's dtype, then the output: a few of
    # its units in the last place of the output's scale
    scale = want.abs().max().item()
    torch.testing.assert_close(got.float(), want, atol=TOLERANCE[dtype] * scale, rtol=TOLERANCE[dtype])
    return got


def test_packing_matches_compressed_tensors() -> None:
    """The layout the kernel reads is compressed-tensors' pack_to_int32 (num_bits 4, packed
    along the inputs): this file's `pack` and `unpack` against its own, both ways."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q = torch.randint(-8, 8, (3, 40, 64), generator=torch.Generator().manual_seed(3), dtype=torch.int8)
    theirs = helpers.pack_to_int32(q, 4)
    assert torch.equal(pack(q), theirs)
    assert torch.equal(unpack(theirs), q.to(torch.int64))
    assert torch.equal(helpers.unpack_from_int32(theirs, 4, q.shape).to(torch.int64), unpack(pack(q)))
    # one word by hand: inputs 0..7 = levels 1..8 (q = -7..0), lowest nibble first
    assert pack(torch.arange(-7, 1).view(1, 8)).item() & 0xFFFFFFFF == 0x87654321


def test_torch_dequantize_is_the_reference() -> None:
    """`dequantize_int4` (the bench's reference on a GPU) against this file's unpacking."""
    packed, scales = quantized_experts(2, 16, 64, torch.float16, 4)
    want = unpack(packed).float() * scales.float().repeat_interleave(32, dim=-1)
    assert torch.equal(dequantize_int4(packed, scales), want)
    assert torch.equal(dequantize_int4(packed[1], scales[1]), want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("counts", [[1, 0, 2, 5, 0, 3, 4, 1], [0, 0, 0, 0, 0, 0, 0, 3], [5, 4, 3, 2, 1, 0, 0, 0]])
def test_tiny_model_shapes(dtype: torch.dtype, counts: list[int]) -> None:
    """The tiny MoE's experts (E=8, K=64 in, N=32 out), 0..5 rows each: every row of every
    expert against the reference, an empty expert's neighbours included."""
    check(counts, 32, 64, dtype)


@pytest.mark.parametrize("split_k", [1, 2])
def test_rows_outside_the_experts_are_left_alone(split_k: int) -> None:
    """Rows before offsets[0] and after offsets[E] (a CUDA graph's padding) are not written,
    split K or not; and M = 0 launches nothing."""
    packed, scales = quantized_experts(2, 32, 256, torch.float32, 5)
    x = torch.randn(7, 256)
    out = torch.full((7, 32), 7.0)
    int4_moe_gemm(x, torch.tensor([1, 3, 5], dtype=torch.int32), packed, scales, out=out, split_k=split_k)
    torch.testing.assert_close(out[1:5], reference(x[1:5], [0, 2, 4], packed, scales), atol=1e-4, rtol=1e-4)
    assert out[[0, 5, 6]].eq(7.0).all()
    assert int4_moe_gemm(x[:0], torch.tensor([0, 0, 0], dtype=torch.int32), packed, scales).shape == (0, 32)


def test_many_rows_per_expert_take_several_row_tiles() -> None:
    """Prefill: an expert with more rows than one tile (BLOCK_M 64), beside small ones."""
    check([70, 0, 3, 131], 48, 64, torch.float16, seed=2, max_rows=131)


# Blocks big enough that the interpreter finishes real expert shapes in seconds (its cost is
# per program and per step); the default blocks are the ones tested at small shapes above, and
# compiled at these shapes' block sizes by test_compiles_for_hopper.py.
BIG_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 512, "BLOCK_K": 512, "num_warps": 4, "num_stages": 1}


@pytest.mark.parametrize(("name", "counts", "n", "k"), [
    ("w13 under TP 8", [2, 0, 1], 2 * 256, 7168),
    ("w2 under TP 8", [1, 0, 3], 7168, 256),
    ("w13 under EP 8", [0, 3], 2 * 2048, 7168),
    ("w2 under EP 8", [2, 0], 7168, 2048),
])
def test_kimi_k25_expert_shapes(name: str, counts: list[int], n: int, k: int) -> None:
    """K2.5's routed experts (hidden 7168, moe_intermediate 2048) split over 8 GPUs: tensor
    parallel (each expert's intermediate / 8) and expert parallel (48 whole experts a rank);
    a few experts (one with rows at the expert-parallel sizes), a few rows, fp16."""
    check(counts, n, k, torch.float16, seed=len(name), split_k=1, config=BIG_BLOCKS)


def test_kimi_k25_decode_with_split_k() -> None:
    """The decode case split K is for: w13 under TP 8 (K 7168) at the default blocks, as many
    splits as the launcher would give a near-empty grid, against the reference."""
    splits = int4_moe_splits(1, 7168, int4_moe_config(2, 512, 7168)["BLOCK_K"], 1000)
    assert splits == 7
    check([0, 2], 512, 7168, torch.float16, seed=4, max_rows=2, split_k=splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split_k", [1, 3])
def test_split_k_adds_the_shares(dtype: torch.dtype, split_k: int) -> None:
    check([2, 0, 3, 1], 64, 1024, dtype, seed=split_k, split_k=split_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split_k", [1, 3])
def test_fused_silu_mul_is_silu_mul_of_the_gemm(dtype: torch.dtype, split_k: int) -> None:
    """w13 stacked [E, 2I, K], gate rows then up rows: the fused output is exactly the
    unfused GEMM's through silu_mul (same sums, same roundings)."""
    packed, scales = quantized_experts(3, 2 * 48, 512, dtype, 9)
    x, offsets = sorted_rows([3, 0, 2], 512, dtype, 10)
    offsets_t = torch.tensor(offsets, dtype=torch.int32)
    fused = int4_moe_gemm(x, offsets_t, packed, scales, silu_mul=True, split_k=split_k)
    unfused = int4_moe_gemm(x, offsets_t, packed, scales, split_k=split_k)
    assert fused.shape == (5, 48)
    # the same sums and roundings; fp32 keeps numpy's exp apart (contiguous or strided: an ulp)
    close = {torch.float32: 1e-5, torch.float16: 0}[dtype]
    torch.testing.assert_close(fused, silu_mul(unfused), atol=close, rtol=close)
    gate_up = reference(x, offsets, packed, scales)
    want = torch.nn.functional.silu(gate_up[:, :48]) * gate_up[:, 48:]
    torch.testing.assert_close(fused.float(), want, atol=TOLERANCE[dtype] * want.abs().max().item(),
                               rtol=TOLERANCE[dtype] * 4)


def test_launch_shape_choices() -> None:
    """One row tile per expert up to 64 rows (decode reads each expert once), the grid's row
    axis a bound on the tiles however the rows split, split K only when the grid is small."""
    assert [int4_moe_config(r, 512, 7168)["BLOCK_M"] for r in (1, 16, 17, 33, 64, 65, 4096)] == \
        [16, 16, 32, 64, 64, 64, 64]
    assert row_tiles(8, 8, 16) == 8  # 8 experts, one row each
    assert row_tiles(64, 8, 64) == 8
    assert row_tiles(4096, 48, 64) == 4096 // 64 + 47
    for counts in ([64] * 8, [1] * 8, [65, 1, 0, 62], [4096]):
        block = 64
        assert sum(-(-c // block) for c in counts) <= row_tiles(sum(counts), len(counts), block)
    assert int4_moe_splits(programs=64, k=7168, block_k=128, target_programs=528) == 7  # 56 steps / 8
    assert int4_moe_splits(programs=200, k=7168, block_k=128, target_programs=528) == 3
    assert int4_moe_splits(programs=600, k=7168, block_k=128, target_programs=528) == 1
    assert int4_moe_splits(programs=8, k=256, block_k=128, target_programs=528) == 1  # w2 under TP 8


@pytest.mark.parametrize("silu", [False, True])
def test_the_gpu_bench_measurement_runs_interpreted(silu: bool) -> None:
    """`tandem bench gpu --int4-moe`'s loop on the CPU (fp16, a tiny stack, a stand-in timer):
    its launches and its check against the dequantized reference, which a GPU run relies on."""
    from tandem.bench.gpu import MoeCase, measure_int4_moe

    calls = []

    def timer(fn) -> float:
        fn()
        calls.append(fn)
        return 1e-5

    case = MoeCase("TP 8", "w13 + silu" if silu else "w13", 8, 64, 128, silu)
    entry = measure_int4_moe(torch, case, 3, (1, 4), timer, device="cpu")
    assert len(calls) == 2 and set(entry["rows"]) == {1, 4}
    assert entry["rows"][4] == {"seconds": 1e-5, "config": int4_moe_config(4, case.width, 128)}
    assert 0 < entry["max_rel_error"] < 5e-3
