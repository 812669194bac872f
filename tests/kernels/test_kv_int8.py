"""--kv-cache-dtype int8: rows of int8 values and their fp32 scale, written by the C kernel
and the torch path alike and read by the C decode kernel, the torch decode and the torch
prefill paths, each against a dense reference over the dequantized cache."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import cpu_attention
from tandem.kernels.base import AttentionMetadata, PrefillSpan, kv_cache_shape
from tandem.kernels.c_library import build_kernel_library
from tandem.kernels.cpu_attention import CpuAttentionBackend, PagedDecodeKernel
from tandem.kernels.kv_format import (
    INT8_SCALE_BYTES,
    dequantize_rows,
    hadamard,
    head_dim_of,
    quantize_rows,
    rotate_rows,
    rotated_values,
    rotation_size,
    stored_row_width,
)
from tandem.kernels.torch_attention import TorchAttentionBackend
from tests.support.attention_cases import one_query_reference
from tests.support.kernel_builds import OTHER_DECODE_BUILDS, decode_kernel_for


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> PagedDecodeKernel:
    return PagedDecodeKernel(build_kernel_library(tmp_path_factory.mktemp("cache"), cpu_attention.SOURCE))


@pytest.fixture(scope="module", params=["native", *OTHER_DECODE_BUILDS])
def isa_kernel(request: pytest.FixtureRequest, kernel: PagedDecodeKernel,
               tmp_path_factory: pytest.TempPathFactory) -> PagedDecodeKernel:
    """The kernel as this CPU runs it (its AVX-512 path where it has one), built for an AVX2
    CPU and for a plain x86-64, so every path reads int8 rows under test on one box."""
    if request.param == "native":
        return kernel
    return decode_kernel_for(request.param, tmp_path_factory.mktemp(request.param))


def test_a_row_keeps_its_scale_and_rounds_to_half_a_step() -> None:
    """In the rotated domain the rows are stored in: each value within half a step of the
    rotated row's, the largest at 127; a zero row reads back as zeros."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=generator) * torch.tensor([0.01, 1.0, 300.0]).view(1, 3, 1)
    rows = quantize_rows(x)
    assert rows.dtype == torch.uint8 and rows.shape == (5, 3, 64 + INT8_SCALE_BYTES)
    rotated = rotate_rows(x)
    step = rotated.abs().amax(-1, keepdim=True) / 127
    assert (rotated_values(rows) - rotated).abs().le(step / 2 + 1e-5 * step).all()
    assert (rows[..., :64].view(torch.int8).abs().amax(-1) == 127).all()  # the largest maps to 127
    # The rotation is its own inverse, so reading back is within the same error's length.
    back = dequantize_rows(rows, torch.float32)
    assert ((back - x).norm(dim=-1) <= (step.squeeze(-1) / 2) * 64**0.5 * (1 + 1e-5)).all()
    zeros = dequantize_rows(quantize_rows(torch.zeros(2, 8)), torch.bfloat16)
    assert zeros.dtype == torch.bfloat16 and not zeros.any()
    assert stored_row_width(64, torch.uint8) == 68 and stored_row_width(64, torch.bfloat16) == 64
    assert head_dim_of(torch.empty(kv_cache_shape(2, 4, 1, 68), dtype=torch.uint8)) == 64


def test_an_outlier_channel_does_not_take_the_row_s_scale() -> None:
    """Qwen2.5's keys have a few channels ~50x the rest. Unrotated, such a channel sets the
    row's scale and the others round to a few levels; rotated, its weight is spread over the
    run of 64, and the other channels come back several times closer."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 2, 128, generator=generator)
    x[..., 5] *= 50.0
    x[..., 70] *= -40.0
    others = torch.ones(128, dtype=torch.bool)
    others[[5, 70]] = False
    error = (dequantize_rows(quantize_rows(x), torch.float32) - x)[..., others].pow(2).mean().sqrt()
    top = x.abs().amax(-1, keepdim=True)
    unrotated = ((x * 127 / top).round() * top / 127 - x)[..., others].pow(2).mean().sqrt()
    assert error < unrotated / 3, (float(error), float(unrotated))


def test_rotation_sizes() -> None:
    assert [rotation_size(d) for d in (64, 128, 192, 576, 32, 16, 80, 96)] == [64, 64, 64, 64, 32, 16, 0, 0]
    x = torch.randn(3, 96)  # no rotation: rows round as they are
    assert torch.equal(rotate_rows(x), x)
    h = hadamard(64)
    torch.testing.assert_close(h @ h, torch.eye(64), rtol=0, atol=1e-6)


def _int8_cache(num_blocks, block, kv_heads, dim, generator) -> torch.Tensor:
    values = torch.randn(kv_cache_shape(num_blocks, block, kv_heads, dim), generator=generator)
    return quantize_rows(values)


def _tables(lengths, block, generator):
    per_seq = [-(-n // block) for n in lengths]
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(lengths), max(per_seq), dtype=torch.long)
    used = 0
    for row, count in enumerate(per_seq):
        tables[row, :count] = order[used : used + count]
        used += count
    return tables, num_blocks


def _reference(q, cache, table, length, kv_heads, dim, scale) -> torch.Tensor:
    """One query [H, D] over the dequantized context of one sequence."""
    return one_query_reference(q, dequantize_rows(cache, torch.float32), table, length, kv_heads, dim, scale)


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
def test_the_c_kernel_reads_int8_rows_as_the_dequantized_reference(isa_kernel, lengths, heads, kv_heads, dim, block,
                                                                   query_dtype) -> None:
    kernel = isa_kernel
    generator = torch.Generator().manual_seed(len(lengths) + heads + dim)
    tables, num_blocks = _tables(lengths, block, generator)
    cache = _int8_cache(num_blocks, block, kv_heads, dim, generator)
    queries = torch.randn(len(lengths), heads, dim, generator=generator).to(query_dtype)
    got = kernel(queries, cache, tables, torch.tensor(lengths), dim**-0.5)
    assert got.dtype == query_dtype
    for row, length in enumerate(lengths):
        want = _reference(queries[row].float(), cache, tables[row], length, kv_heads, dim, dim**-0.5)
        if query_dtype == torch.float32:
            torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(got[row].float(), want.bfloat16().float(), rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_writer_leaves_the_values_the_torch_writer_does(kernel, dtype) -> None:
    """Keys and values as views into a fused projection, written into scattered slots: the
    same rotated rows to a few units in the last place (the C writer's butterflies sum in
    another order than the torch writer's matmul, and -ffast-math may divide by 127 as a
    multiply), so scales within 8 units (5 seen on a Zen AVX-512 EPYC, 4 on a Xeon) and int8
    values equal but where one lay on a rounding boundary (then one step apart)."""
    generator = torch.Generator().manual_seed(3)
    tokens, kv_heads, dim, block, num_blocks = 21, 3, 64, 16, 6
    fused = (torch.randn(tokens, 5 * kv_heads * dim, generator=generator) * 4).to(dtype)
    key = fused[:, : kv_heads * dim].view(tokens, kv_heads, dim)
    value = fused[:, 2 * kv_heads * dim : 3 * kv_heads * dim].view(tokens, kv_heads, dim)
    slots = torch.randperm(num_blocks * block, generator=generator)[:tokens]
    meta = AttentionMetadata(slots, 0, torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long), 0, [],
                             block)
    shape = kv_cache_shape(num_blocks, block, kv_heads, stored_row_width(dim, torch.uint8))
    by_c, by_torch = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
    CpuAttentionBackend(kernel).write_kv(key, value, by_c, meta)
    TorchAttentionBackend().write_kv(key, value, by_torch, meta)
    values_c = by_c[..., :dim].view(torch.int8).int()
    steps = (values_c - by_torch[..., :dim].view(torch.int8).int()).abs()
    assert steps.max() <= 1 and steps.count_nonzero() <= steps.numel() // 1000
    assert values_c.abs().max() == 127
    scales_c = by_c[..., dim:].contiguous().view(torch.float32)
    scales_torch = by_torch[..., dim:].contiguous().view(torch.float32)
    torch.testing.assert_close(scales_c, scales_torch, rtol=2**-20, atol=0)


def test_the_torch_paths_read_int8_rows_as_the_dequantized_reference(kernel) -> None:
    """The torch backend's decode (one stream, a padded batch, a split batch) and its prefill
    over a cached prefix, on an int8 cache, equal the same backend on the dequantized cache;
    the C backend's decode agrees with both."""
    generator = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, block = 6, 2, 32, 8
    lengths = [3, 8, 9, 12, 17, 25, 30, 33, 40]  # the runner orders decodes by context length
    tables, num_blocks = _tables(lengths, block, generator)
    cache = _int8_cache(num_blocks, block, kv_heads, dim, generator)
    widened = dequantize_rows(cache, torch.float32)
    backend, kernel_backend = TorchAttentionBackend(), CpuAttentionBackend(kernel)
    for rows in (slice(0, 1), slice(0, 3), slice(0, 9)):
        lens = torch.tensor(lengths[rows])
        meta = AttentionMetadata(torch.empty(0, dtype=torch.long), len(lens), tables[rows], lens, int(lens.max()), [],
                                 block)
        q = torch.randn(len(lens), heads, dim, generator=generator)
        want = backend._decode(q, widened, meta, 0.2)
        torch.testing.assert_close(backend._decode(q, cache, meta, 0.2), want)
        torch.testing.assert_close(kernel_backend._decode(q, cache, meta, 0.2), want, rtol=1e-5, atol=1e-5)
    # A 12-token chunk after 28 cached tokens of the last sequence (its keys already written).
    span = PrefillSpan(0, 12, 40, tables[8, :5])
    q = torch.randn(12, heads, dim, generator=generator)
    k, v = torch.randn(12, kv_heads, dim), torch.randn(12, kv_heads, dim)
    torch.testing.assert_close(backend._prefill(q, k, v, cache, span, 0.2), backend._prefill(q, k, v, widened, span, 0.2))
