"""The Triton kernels against the torch reference backend, in Triton's CPU interpreter (and
on a GPU when one runs them): block sizes, head sizes 64 and 128, GQA ratios, contexts that
cross block boundaries, split and unsplit decodes, chunks with and without a cached prefix."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.base import AttentionMetadata, kv_cache_shape
from tandem.kernels.gpu.backend import TritonAttentionBackend
from tandem.kernels.gpu.cache_write import fused_int8_write, write_kv, write_kv_fp8, write_kv_int8
from tandem.kernels.gpu.decode_attention import decode_splits, paged_decode_attention
from tandem.kernels.gpu.rms_norm import rms_norm
from tandem.kernels.kv_format import quantize_rows, to_fp8
from tandem.kernels.torch_attention import TorchAttentionBackend
from tandem.layers.norm import RMSNorm
from tests.support.attention_cases import (
    assert_stored_as_the_reference,
    mixed_step,
    scattered_tables,
)

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}


def _cache(blocks: int, block_size: int, kv_heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(kv_cache_shape(blocks, block_size, kv_heads, dim), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_puts_each_token_in_its_slot_and_skips_padding(dtype: torch.dtype, block_size: int) -> None:
    torch.manual_seed(0)
    cache, reference = (_cache(6, block_size, 3, 64, dtype) for _ in range(2))
    reference.copy_(cache)
    slots = torch.tensor([5, block_size, 3 * block_size + 7, -1, 6 * block_size - 1])
    qkv = torch.randn(5, 3 * 2 * 64, dtype=dtype)  # key and value as views into one projection
    key, value = qkv[:, :192].view(5, 3, 64), qkv[:, 192:].view(5, 3, 64)
    write_kv(key, value, cache, slots)
    meta = AttentionMetadata(slots[[0, 1, 2, 4]], 0, torch.zeros(0, 1, dtype=torch.int64),
                             torch.zeros(0, dtype=torch.int64), 0, [], block_size)
    TorchAttentionBackend().write_kv(key[[0, 1, 2, 4]], value[[0, 1, 2, 4]], reference, meta)
    assert torch.equal(cache, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 64), (9, 3, 64), (14, 2, 64), (12, 2, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_the_torch_backend(dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
                                          block_size: int, splits: int) -> None:
    generator = torch.Generator().manual_seed(heads * 1000 + dim + block_size + splits)
    torch.manual_seed(heads + dim)
    contexts = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 100]
    blocks = sum(-(-c // block_size) for c in contexts) + 3
    cache = _cache(blocks, block_size, kv_heads, dim, dtype)
    tables = scattered_tables(contexts, block_size, blocks, generator)
    lens = torch.tensor(contexts)
    query = torch.randn(len(contexts), heads, dim, dtype=dtype)
    scale = dim ** -0.5
    got = paged_decode_attention(query, cache, tables, lens, max(contexts), scale, splits)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), len(contexts), tables, lens, max(contexts), [],
                             block_size)
    want = TorchAttentionBackend()._decode(query.float(), cache.float(), meta, scale)
    torch.testing.assert_close(got.float(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("splits", [1, 3])
def test_padded_rows_read_nothing_and_give_zeros(splits: int) -> None:
    """A CUDA graph's padding rows: context 0 (and a max context far past every real row's,
    as a graph captures it); the real rows' outputs are unchanged, the padding's are zeros."""
    torch.manual_seed(splits)
    block_size, contexts = 16, [20, 0, 35, 0]
    cache = _cache(8, block_size, 2, 64, torch.float32)
    tables = scattered_tables([c or 1 for c in contexts], block_size, 8, torch.Generator().manual_seed(1))
    query = torch.randn(len(contexts), 4, 64)
    got = paged_decode_attention(query, cache, tables, torch.tensor(contexts), 128, 0.125, splits)
    real = [0, 2]
    want = paged_decode_attention(query[real], cache, tables[real], torch.tensor([20, 35]), 35, 0.125, 1)
    torch.testing.assert_close(got[real], want, atol=2e-5, rtol=2e-5)
    assert got[[1, 3]].eq(0).all()


def test_the_fp8_write_stores_torchs_bytes_for_every_code_tie_and_special() -> None:
    """The fp8 write kernel rounds in integer arithmetic on the fp32's bits: every finite e4m3
    value, each midpoint between neighbours (ties to even) and the floats either side of it,
    both signs, past 448 (saturated), subnormals, zeros and NaN, times each plane's multiplier,
    give the bytes of torch's clamp and cast; a negative slot writes nothing."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(-float("inf"))
    near = torch.cat([mids, mids.nextafter(up), mids.nextafter(down)])
    values = torch.cat([finite, near, -near, torch.tensor([448.0, 449.0, 464.0, 465.0, 1e6, -1e6, 0.0, -0.0,
                                                           float("nan"), 1e-9, -2.0**-10, 3 * 2.0**-10])])
    heads, dim = 2, 64
    tokens = -(-values.numel() // (heads * dim))
    flat = torch.zeros(tokens * heads * dim)
    flat[: values.numel()] = values
    key = flat.view(tokens, heads, dim)
    value = (flat * 3).view(tokens, heads, dim)
    blocks = -(-tokens // 16) + 1
    cache = torch.zeros(kv_cache_shape(blocks, 16, heads, dim), dtype=torch.float8_e4m3fn)
    slots = torch.randperm(blocks * 16, generator=torch.Generator().manual_seed(0))[: tokens + 1]
    padded = torch.cat([slots[:tokens], torch.tensor([-1])])
    write_kv_fp8(torch.cat([key, key[:1]]), torch.cat([value, value[:1]]), cache, padded, 1.0, 0.25)
    stored = cache.view(torch.uint8).permute(0, 2, 3, 1, 4).reshape(2, blocks * 16, heads, dim)
    assert torch.equal(stored[0][slots[:tokens]], to_fp8(key).view(torch.uint8))
    assert torch.equal(stored[1][slots[:tokens]], to_fp8(value * 0.25).view(torch.uint8))
    assert stored[:, slots[tokens]].count_nonzero() == 0  # the padding row's slot stayed empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "dim"), [(9, 64), (32, 128), (14, 64), (4, 16)])
def test_the_rotation_kernel_rotates_a_strided_query_as_torch_does(dtype: torch.dtype, heads: int, dim: int) -> None:
    """An int8 cache's query / output rotation in one kernel: a query split from the fused
    projection (tokens strided), each run rotated in fp32 and rounded once, as
    rotate_rows(x.float()).to(x.dtype) gives it; and rotating twice gives the rows back."""
    from tandem.kernels.gpu.rotation import fused_rotation, rotate_heads
    from tandem.kernels.kv_format import rotate_rows

    assert fused_rotation(dim) and not fused_rotation(80)  # 80: one run of 16, five a row
    qkv = torch.randn(5, (heads + 4) * dim, generator=torch.Generator().manual_seed(heads)).to(dtype)
    query = qkv[:, : heads * dim].view(5, heads, dim)
    got = rotate_heads(query)
    assert got.is_contiguous() and got.dtype == dtype
    torch.testing.assert_close(got, rotate_rows(query.float()).to(dtype), atol=TOLERANCE[dtype] / 10,
                               rtol=TOLERANCE[dtype] / 10)
    torch.testing.assert_close(rotate_heads(got), query, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_decode_splits_fill_the_device_but_keep_a_few_blocks_each() -> None:
    assert decode_splits(rows=1, kv_heads=8, max_blocks=4, target_programs=264) == 1
    assert decode_splits(rows=1, kv_heads=8, max_blocks=512, target_programs=264) == 33
    assert decode_splits(rows=64, kv_heads=8, max_blocks=512, target_programs=264) == 1
    assert decode_splits(rows=1, kv_heads=2, max_blocks=40, target_programs=264) == 10
    assert decode_splits(rows=1, kv_heads=1, max_blocks=8192, target_programs=10_000) == 64


@pytest.mark.parametrize(("dtype", "kv"), [(torch.float32, "auto"), (torch.float16, "auto"),
                                          (torch.float32, "fp8"), (torch.float16, "fp8"),
                                          (torch.float32, "int8"), (torch.float16, "int8")])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (12, 2, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_a_mixed_batch_matches_the_torch_backend(dtype: torch.dtype, kv: str, heads: int, kv_heads: int,
                                                 dim: int, block_size: int) -> None:
    """The mixed step of tests/support/attention_cases.py: two decodes and three prefill chunks
    (a fresh prompt, a chunk after a cached prefix that ends mid-block, a one-token chunk), the
    step's K/V written by the backend. Both backends store the same bytes (fp8: each key and
    value rounded to e4m3; int8: rotated rows and their scales, the Triton write kernel's to
    a level on a rounding boundary), and the reference attends over what it stored, in fp32."""
    step = mixed_step(dtype, kv, heads, kv_heads, dim, block_size)
    assert_stored_as_the_reference(step, kv, dim)
    torch.testing.assert_close(step.got.float(), step.want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cols", [576, 1000])
def test_rms_norm_alone_and_fused_with_the_residual_add(dtype: torch.dtype, cols: int) -> None:
    torch.manual_seed(cols)
    layer = RMSNorm(cols, 1e-5)
    layer.weight.data = torch.randn(cols).to(dtype)
    x = torch.randn(7, cols, dtype=dtype)
    residual = torch.randn(7, cols, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, layer.weight, 1e-5), layer(x),
                                   atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        summed = x + residual
        fused_residual = residual.clone()
        out = rms_norm(x, layer.weight, 1e-5, fused_residual)
        assert torch.equal(fused_residual, summed)  # the sum is stored in place, rounded as torch rounds it
        torch.testing.assert_close(out, layer(summed), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_the_backend_refuses_what_its_kernels_cannot_read() -> None:
    with pytest.raises(ValueError, match="power of two >= 16"):
        TritonAttentionBackend.check(torch.zeros(kv_cache_shape(4, 8, 2, 64)))
    with pytest.raises(ValueError, match="key and a value plane"):
        TritonAttentionBackend.check(torch.zeros(kv_cache_shape(4, 16, 1, 64, num_planes=1)))
    with pytest.raises(ValueError, match="multiple of 4"):  # int8 rows of 66 values and a scale
        TritonAttentionBackend.check(torch.zeros(kv_cache_shape(4, 16, 2, 70), dtype=torch.uint8))
    TritonAttentionBackend.check(torch.zeros(kv_cache_shape(4, 16, 2, 68), dtype=torch.uint8))


@pytest.mark.parametrize("shape", [(5, 96), (3, 4, 64)])
def test_rms_norm_module_through_the_triton_pass(shape: tuple[int, ...]) -> None:
    """RMSNorm with the GPU's pass attached (here interpreted, in fp16: the interpreter mangles
    bf16): transformers' formula, also for q/k norms' [T, heads, dim]; fp32 keeps torch's op."""
    from tandem.kernels.gpu.rms_norm import TritonNorm
    from tandem.kernels.gpu.rotary import TritonRotary
    from tandem.kernels.gpu.silu_mul import TritonSiluMul
    from tandem.layers.fused_ops import attach_gpu_passes

    torch.manual_seed(3)
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data = torch.randn(shape[-1]).half()
    x = torch.randn(shape).half()
    want = norm(x)
    assert attach_gpu_passes(norm, TritonNorm(), TritonRotary(), TritonSiluMul()) == 1 and TritonNorm.takes_norm(x, norm.weight)
    torch.testing.assert_close(norm(x), want, atol=2e-3, rtol=2e-3)
    assert not TritonNorm.takes_norm(x.float(), norm.weight.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "dim"), [(12, 64), (40, 128), (100, 64)])
def test_rotary_kernel_equals_the_torch_formula(dtype: torch.dtype, heads: int, dim: int) -> None:
    """In place on q and k side by side in a projection's output (token stride wider than the
    heads), with torch's roundings: equal to RotaryEmbedding's ops, bit for bit."""
    from tandem.config import RopeConfig
    from tandem.kernels.gpu.rotary import TritonRotary
    from tandem.layers.rotary import RotaryEmbedding

    torch.manual_seed(heads)
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), dim, 256, dtype)
    tokens = 5
    projection = torch.randn(tokens, (heads + 3) * dim).to(dtype)
    qk = projection[:, : heads * dim].view(tokens, heads, dim)
    angles = rotary.angles(torch.tensor([0, 1, 17, 200, 255]))
    want = rotary(angles, qk.clone())
    untouched = projection[:, heads * dim:].clone()
    assert TritonRotary.takes_rotary(qk, angles[0])
    assert TritonRotary.rotary_(qk, *angles).data_ptr() == qk.data_ptr()
    assert torch.equal(qk, want)
    assert torch.equal(projection[:, heads * dim:], untouched)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [96, 1536, 2500])
def test_silu_mul_kernel_against_torch(dtype: torch.dtype, width: int) -> None:
    """[T, 2I] gate then up -> silu(gate) * up, rounded as torch rounds; the exp may differ from
    torch's in its last bit, so within one unit of the dtype's last place."""
    from tandem.kernels.gpu.silu_mul import TritonSiluMul

    torch.manual_seed(width)
    gate_up = (torch.randn(3, 2 * width) * 4).to(dtype)
    gate, up = gate_up.split(width, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert TritonSiluMul.takes_silu_mul(gate_up)
    got = TritonSiluMul.silu_mul(gate_up)
    tolerance = {torch.float32: 1e-6, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def test_gate_up_and_rotary_modules_take_the_gpu_passes_where_attached() -> None:
    """Attached to a model's modules, the passes run in place of torch's ops (fp16 here)."""
    from tandem.config import RopeConfig
    from tandem.kernels.gpu.rms_norm import TritonNorm
    from tandem.kernels.gpu.rotary import TritonRotary
    from tandem.kernels.gpu.silu_mul import TritonSiluMul
    from tandem.layers.fused_ops import attach_gpu_passes
    from tandem.layers.linear import GateUpLinear
    from tandem.layers.rotary import RotaryEmbedding

    torch.manual_seed(5)
    model = torch.nn.ModuleDict({"mlp": GateUpLinear(32, 48), "rotary": RotaryEmbedding(RopeConfig(theta=1e4), 16, 64, torch.float16),
                                 "norm": RMSNorm(32, 1e-6)}).half()
    model["mlp"].weight.data.normal_()
    x = torch.randn(4, 32).half()
    qk = torch.randn(4, 3, 16).half()
    angles = model["rotary"].angles(torch.arange(4))
    want_mlp, want_rotated = model["mlp"](x), model["rotary"](angles, qk.clone())
    calls = []

    class CountedRotary(TritonRotary):
        def rotary_(self, *args: torch.Tensor) -> torch.Tensor:
            calls.append("rotary")
            return super().rotary_(*args)

    class CountedSiluMul(TritonSiluMul):
        def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
            calls.append("silu_mul")
            return super().silu_mul(gate_up)

    assert attach_gpu_passes(model, TritonNorm(), CountedRotary(), CountedSiluMul()) == 3
    torch.testing.assert_close(model["mlp"](x), want_mlp, atol=2e-3, rtol=2e-3)
    assert torch.equal(model["rotary"].rotate_(angles, qk), want_rotated)
    assert calls == ["silu_mul", "rotary"]


@pytest.mark.parametrize(("kv_heads", "dim"), [(3, 64), (2, 128), (1, 256), (5, 32)])
def test_the_int8_write_kernel_rounds_as_quantize_rows(kv_heads: int, dim: int) -> None:
    """The fused int8 write against quantize_rows' rows placed by the plain write: the same
    levels (to one on a rounding boundary) and scales, a padding slot left alone, a zero row
    stored as zeros with scale 0, and a large channel spread by the rotation."""
    torch.manual_seed(dim)
    cache = quantize_rows(_cache(6, 16, kv_heads, dim, torch.float32))
    reference = cache.clone()
    slots = torch.tensor([5, 16, 55, -1, 95])
    key, value = torch.randn(5, kv_heads, dim), torch.randn(5, kv_heads, dim)
    key[:, :, 3] *= 40.0  # an outlier channel, as Qwen2.5's keys have
    value[2] = 0.0
    assert fused_int8_write(dim)
    write_kv_int8(key, value, cache, slots)
    kept = slots >= 0
    write_kv(quantize_rows(key[kept]), quantize_rows(value[kept]), reference, slots[kept])
    levels = cache[..., :dim].view(torch.int8).int()
    want = reference[..., :dim].view(torch.int8).int()
    assert (levels - want).abs().max() <= 1 and (levels != want).float().mean() < 0.01
    torch.testing.assert_close(cache[..., dim:].contiguous().view(torch.float32),
                               reference[..., dim:].contiguous().view(torch.float32), rtol=1e-6, atol=0)
    zero_row = cache[1, :, 55 // 16, 55 % 16]
    assert not zero_row.any()  # values and scale


def test_the_int8_write_kernel_takes_runs_it_can_rotate_with_a_dot() -> None:
    """Head sizes whose rotation runs are 16+ values, a power of two of them to a row: the
    others (MLA's 576-wide latent: nine runs; 80: no rotation) are rounded in torch."""
    assert [d for d in (8, 16, 32, 64, 80, 96, 128, 192, 256, 576) if fused_int8_write(d)] == [16, 32, 64, 128, 256]


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("splits", [1, 2])
def test_int8_rows_read_in_lanes_as_split_into_bytes(dim: int, splits: int) -> None:
    """The decode kernel over an int8 cache: rows read as words in four lanes (head sizes of
    64+) against the same words split into bytes in registers (the prefill kernel's way, and
    the decode kernel's for narrower heads)."""
    torch.manual_seed(dim + splits)
    generator = torch.Generator().manual_seed(3)
    contexts = [40, 17, 3]
    cache = quantize_rows(_cache(12, 16, 2, dim, torch.float32))
    tables = scattered_tables(contexts, 16, 12, generator)
    query = torch.randn(len(contexts), 8, dim)
    lens = torch.tensor(contexts)
    lanes = paged_decode_attention(query, cache, tables, lens, max(contexts), dim ** -0.5, splits, int8_lanes=True)
    split = paged_decode_attention(query, cache, tables, lens, max(contexts), dim ** -0.5, splits,
                                     int8_lanes=False)
    torch.testing.assert_close(lanes, split, atol=2e-6, rtol=2e-6)
