"""--kv-cache-dtype fp8 on the CPU backends: float8 e4m3 bytes written by the C writer as
torch's saturating cast writes them, widened exactly by the C decode kernel on each ISA path
(AVX-512, AVX2, portable), and a mixed step of decodes and prefill chunks through the C
backend and the torch backend (and an int8 cache through the C backend, whose prefill also
reads widened blocks) against the torch backend in fp32 over the same rounded values."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import cpu_attention
from tandem.kernels.base import AttentionMetadata, kv_cache_shape
from tandem.kernels.c_library import build_kernel_library
from tandem.kernels.cpu_attention import CpuAttentionBackend, PagedDecodeKernel
from tandem.kernels.cpu_prefill import PrefillAttentionKernel
from tandem.kernels.kv_format import FP8, FP8_MAX, to_fp8
from tandem.kernels.torch_attention import TorchAttentionBackend
from tests.support.attention_cases import (
    assert_stored_as_the_reference,
    mixed_step,
    one_query_reference,
    scattered_tables,
)
from tests.support.kernel_builds import OTHER_DECODE_BUILDS, decode_kernel_for


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> PagedDecodeKernel:
    return PagedDecodeKernel(build_kernel_library(tmp_path_factory.mktemp("cache"), cpu_attention.SOURCE))


@pytest.fixture(scope="module", params=["native", *OTHER_DECODE_BUILDS])
def isa_kernel(request: pytest.FixtureRequest, kernel: PagedDecodeKernel,
               tmp_path_factory: pytest.TempPathFactory) -> PagedDecodeKernel:
    """The kernel as this CPU runs it, built for an AVX2 CPU and for a plain x86-64."""
    if request.param == "native":
        return kernel
    return decode_kernel_for(request.param, tmp_path_factory.mktemp(request.param))


def _codes_cache(dim: int) -> tuple[torch.Tensor, int]:
    """A one-kv-head cache whose value rows hold every byte but e4m3's two NaNs, in order, and
    whose keys are zero: each sequence of one token reads one value row back as its output."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    rows = -(-len(codes) // dim)
    cache = torch.zeros(kv_cache_shape(rows, 1, 1, dim), dtype=torch.uint8)
    cache[1].view(-1)[: len(codes)] = codes
    return cache.view(FP8), rows


def test_every_byte_widens_as_torch_reads_it(isa_kernel) -> None:
    """Subnormals (which the vector paths widen through fp16 subnormals, and which the
    process's flush-to-zero must not touch), both zeros, 448 and every normal in between: the
    kernel's output for a one-token context is its value row, widened."""
    dim = 64
    cache, rows = _codes_cache(dim)
    tables = torch.arange(rows).view(rows, 1)
    q = torch.randn(rows, 1, dim)
    got = isa_kernel(q, cache, tables, torch.ones(rows, dtype=torch.int64), dim**-0.5)
    want = cache[1].reshape(rows, 1, dim).float()
    assert torch.equal(got, want)
    assert want.abs().max() == FP8_MAX and (want.abs() < 2**-6).sum() > 8  # the range's ends were read


def _fp8_values() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties, rounding to even),
    points a quarter-step either side, magnitudes past 448 and below the smallest subnormal,
    both zeros, NaN, and random values over e4m3's whole range."""
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8).view(FP8).float()
    ordered = finite.unique().sort().values
    gaps = ordered[1:] - ordered[:-1]
    mids = ordered[:-1] + gaps / 2
    near = torch.cat((mids - gaps / 4, mids + gaps / 4))
    generator = torch.Generator().manual_seed(11)
    wide = torch.randn(4096, generator=generator) * torch.exp2(torch.randint(-12, 10, (4096,), generator=generator))
    extremes = torch.tensor([448.0, 463.9, 464.0, 465.0, 1e4, float("inf"), 2.0**-10, 2.0**-11, 1e-30, -0.0, 0.0])
    values = torch.cat((ordered, mids, near, wide, extremes, -extremes, torch.tensor([float("nan")])))
    return values[: values.numel() // 64 * 64]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_writer_stores_the_bytes_of_torch_s_saturating_cast(kernel, dtype) -> None:
    """Keys and values as views into a fused projection, written into scattered slots: every
    byte equals clamp(-448, 448) then torch's cast (to nearest, ties to even), NaN included."""
    values = _fp8_values().to(dtype)
    kv_heads, dim, block = 2, 32, 16
    tokens = values.numel() // (kv_heads * dim)
    fused = torch.zeros(tokens, 5 * kv_heads * dim, dtype=dtype)
    key = fused[:, : kv_heads * dim].view(tokens, kv_heads, dim)
    value = fused[:, 2 * kv_heads * dim: 3 * kv_heads * dim].view(tokens, kv_heads, dim)
    key.copy_(values.view(tokens, kv_heads, dim))
    value.copy_(values.flip(0).view(tokens, kv_heads, dim))
    num_blocks = -(-tokens // block) + 2
    slots = torch.randperm(num_blocks * block, generator=torch.Generator().manual_seed(3))[:tokens]
    meta = AttentionMetadata(slots, 0, torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long), 0, [],
                             block)
    shape = kv_cache_shape(num_blocks, block, kv_heads, dim)
    by_c, by_torch = torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8)
    CpuAttentionBackend(kernel).write_kv(key, value, by_c, meta)
    TorchAttentionBackend().write_kv(key, value, by_torch, meta)
    assert torch.equal(by_c.view(torch.uint8), by_torch.view(torch.uint8))
    stored = by_c.view(2, kv_heads, -1, dim)[0][:, slots].transpose(0, 1)  # the keys, back in token order
    assert torch.equal(stored.view(torch.uint8), to_fp8(key.float()).view(torch.uint8))


def _reference(q, cache, table, length, kv_heads, dim, scale) -> torch.Tensor:
    """One query [H, D] over the widened context of one sequence."""
    return one_query_reference(q, cache.float(), table, length, kv_heads, dim, scale)


@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads", "dim", "block"),
    [
        ([1], 9, 3, 64, 16),  # one token of context
        ([5, 200, 17, 64, 3, 90], 9, 3, 64, 16),  # partial last blocks, a query head per item
        ([40] * 70, 9, 3, 64, 16),  # many sequences: a kv head's query heads per item
        ([7, 33, 12], 8, 8, 32, 4),  # no grouping (MHA), small blocks
        ([300, 129], 16, 2, 128, 32),  # wide heads, 8 query heads per kv head
        ([1000], 7, 1, 64, 16),  # a lone stream's long context: its keys cut into spans
    ],
)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_the_c_kernel_reads_fp8_as_the_widened_reference(isa_kernel, lengths, heads, kv_heads, dim, block,
                                                          query_dtype) -> None:
    generator = torch.Generator().manual_seed(len(lengths) + heads + dim)
    num_blocks = sum(-(-n // block) for n in lengths) + 3
    tables = scattered_tables(lengths, block, num_blocks, generator)
    cache = to_fp8(torch.randn(kv_cache_shape(num_blocks, block, kv_heads, dim), generator=generator) * 3)
    queries = torch.randn(len(lengths), heads, dim, generator=generator).to(query_dtype)
    got = isa_kernel(queries, cache, tables, torch.tensor(lengths), dim**-0.5)
    assert got.dtype == query_dtype
    for row, length in enumerate(lengths):
        want = _reference(queries[row].float(), cache, tables[row], length, kv_heads, dim, dim**-0.5)
        if query_dtype == torch.float32:
            torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(got[row].float(), want.bfloat16().float(), rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize(("which", "kv"), [("cpu", "fp8"), ("torch", "fp8"), ("cpu", "int8")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), [(9, 3, 64, 16), (4, 4, 32, 8)])
def test_a_mixed_step_over_an_8_bit_cache_matches_the_fp32_reference(tmp_path_factory, kernel, which, kv, dtype,
                                                                      heads, kv_heads, dim, block_size) -> None:
    """Two decodes and three prefill chunks (a fresh prompt, a chunk after a cached prefix that
    ends mid-block, a one-token chunk) write and attend through the backend; the torch backend
    in fp32 over the same rounded values is the reference, and the stored bytes are its (int8:
    to a level on a rounding boundary). The C backend's prefill chunks read the span's blocks
    widened into a dense cache of the queries' dtype by the C prefill kernel."""
    backend = (CpuAttentionBackend(kernel, PrefillAttentionKernel.build(tmp_path_factory.mktemp("prefill")))
               if which == "cpu" else TorchAttentionBackend())
    step = mixed_step(dtype, kv, heads, kv_heads, dim, block_size, backend=backend)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(step.got.float(), step.want, rtol=tolerance, atol=tolerance)
    assert_stored_as_the_reference(step, kv, dim)


@pytest.mark.parametrize("cache_kind", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_widen_for_the_prefill_kernel_as_torch_widens_them(kernel, cache_kind, dtype) -> None:
    """A prefill chunk over an int8 or fp8 cache reads its span's blocks widened into a dense
    cache of the queries' dtype: fp8 exactly torch's widening; int8 rows to a few units in the
    last place (the C rotation's butterflies sum in another order than torch's matmul)."""
    from tandem.kernels.kv_format import quantize_rows, widen

    generator = torch.Generator().manual_seed(9)
    values = torch.randn(kv_cache_shape(12, 16, 3, 64), generator=generator) * 3
    cache = to_fp8(values) if cache_kind == "fp8" else quantize_rows(values)
    blocks = torch.tensor([7, 2, 11, 0, 5])
    got = kernel.widen_blocks(cache, blocks, dtype)
    want = widen(cache[:, :, blocks], dtype)
    assert got.shape == want.shape == (2, 3, 5, 16, 64) and got.dtype == dtype
    if cache_kind == "fp8":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-5)
