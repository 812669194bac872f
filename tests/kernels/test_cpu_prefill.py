"""The C prefill-attention kernel against masked SDPA, and the CPU backend's use of it."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import cpu_attention, cpu_prefill
from tandem.kernels.base import AttentionMetadata, PrefillSpan, kv_cache_shape
from tandem.kernels.c_library import build_kernel_library
from tandem.kernels.cpu_attention import CpuAttentionBackend, PagedDecodeKernel
from tandem.kernels.cpu_prefill import PrefillAttentionKernel
from tandem.kernels.torch_attention import TorchAttentionBackend
from tandem.platform.cpu_modes import CpuFeatures


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def kernel(cache_dir) -> PrefillAttentionKernel:
    return PrefillAttentionKernel.build(cache_dir)


def _paged(context: int, kv_heads: int, dim: int, block: int, dtype, generator):
    """A cache holding one sequence's `context` tokens in shuffled blocks, with spare blocks
    full of NaN that nobody may read."""
    used = -(-context // block)
    cache = torch.full(kv_cache_shape(used + 3, block, kv_heads, dim), float("nan"))
    order = torch.randperm(used + 3, generator=generator)
    block_ids = order[:used].clone()
    flat = cache.view(2, kv_heads, -1, dim)
    slots = block_ids.repeat_interleave(block) * block + torch.arange(block).repeat(used)
    flat[:, :, slots[:context]] = torch.randn(2, kv_heads, context, dim, generator=generator)
    return cache.to(dtype), block_ids


def _rising(context: int, q_len: int, heads: int, kv_heads: int, dim: int, block: int, dtype, generator,
            rise: float = 0.3):
    """Keys that each score above the one before, by ~0.43 in log2 units at scale 1/8 (`rise`
    0.3): the running maximum moves at every key group, by ~7, and the output so far is
    rescaled each time (random keys move it a few times a tile)."""
    cache, block_ids = _paged(context, kv_heads, dim, block, torch.float32, generator)
    used = block_ids.numel()
    slots = block_ids.repeat_interleave(block) * block + torch.arange(block).repeat(used)
    cache.view(2, kv_heads, -1, dim)[0, :, slots[:context], 0] += rise * torch.arange(context)
    q = torch.randn(q_len, heads, dim, generator=generator)
    q[..., 0] = 8.0
    return cache.to(dtype), block_ids, q.to(dtype)


def _reference(q, cache, block_ids, context: int, scale: float) -> torch.Tensor:
    """Masked SDPA in fp32 over the gathered context."""
    q_len, _, dim = q.shape
    kv_heads = cache.shape[1]
    keys = cache[0][:, block_ids].reshape(kv_heads, -1, dim)[:, :context].float()
    values = cache[1][:, block_ids].reshape(kv_heads, -1, dim)[:, :context].float()
    mask = torch.arange(context)[None] <= torch.arange(context - q_len, context)[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys[None], values[None],
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize(
    ("q_len", "context", "heads", "kv_heads", "dim", "block"),
    [
        (1, 1, 9, 3, 64, 16),  # a one-token prompt
        (5, 5, 9, 3, 64, 16),  # fewer queries than a tile, nothing cached
        (37, 37, 9, 3, 64, 16),  # tiles and key groups ending mid-way, nothing cached
        (37, 100, 9, 3, 64, 16),  # after a cached prefix that ends mid-block
        (200, 233, 14, 2, 64, 16),  # Qwen2.5-0.5B's heads (7 per kv head)
        (33, 70, 12, 2, 128, 32),  # Qwen2.5-1.5B's head size, blocks of 32
        (17, 17, 4, 4, 32, 4),  # no grouping, blocks smaller than a key group
        (16, 48, 6, 1, 64, 16),  # exactly one tile after three full key groups
        (21, 40, 4, 2, 48, 16),  # a head size of 16 x odd: bf16 pairs end in half a block
        # contexts of several key ranges (AMX: 128 keys at head sizes 32-64, 512 above), which a
        # group's heads take in turns
        (200, 700, 14, 2, 64, 16),  # 7 heads an item over several ranges
        (72, 600, 12, 2, 128, 32),  # a head size whose output stays in memory, 6 heads an item
        (19, 530, 14, 2, 64, 16),  # too few tiles for whole groups: one head an item
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_masked_sdpa(kernel, q_len, context, heads, kv_heads, dim, block, dtype) -> None:
    generator = torch.Generator().manual_seed(q_len * 1000 + context)
    cache, block_ids = _paged(context, kv_heads, dim, block, dtype, generator)
    q = torch.randn(q_len, heads, dim, generator=generator).to(dtype)
    got = kernel(q, cache, block_ids, context, dim**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    want = _reference(q, cache, block_ids, context, dim**-0.5)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    else:  # P is rounded to bf16 before P.V and the output to bf16, as in bf16 flash attention
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize(("q_len", "context", "heads", "kv_heads", "dim"),
                         [(200, 700, 9, 3, 64), (72, 600, 12, 2, 128)])
def test_bf16_outputs_are_rounded_to_nearest(kernel, q_len, context, heads, kv_heads, dim) -> None:
    """The output rows' rounding to bf16 is to nearest: about half the outputs land above the
    fp32 reference in magnitude (0.499 here), where truncating toward zero leaves ~0.2. The
    tolerance of the test above lets either through."""
    generator = torch.Generator().manual_seed(7)
    cache, block_ids = _paged(context, kv_heads, dim, 16, torch.bfloat16, generator)
    q = torch.randn(q_len, heads, dim, generator=generator).to(torch.bfloat16)
    got = kernel(q, cache, block_ids, context, dim**-0.5).float()
    want = _reference(q, cache, block_ids, context, dim**-0.5)
    above = (got.abs() > want.abs()).float().mean().item()
    assert 0.4 < above < 0.6


@pytest.mark.parametrize(
    ("context", "q_len", "heads", "kv_heads", "dim"),
    [(200, 60, 9, 3, 64), (700, 130, 14, 2, 64), (600, 100, 12, 2, 128)],  # 1 and 3 key ranges
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_that_keep_rising_along_the_context(kernel, context, q_len, heads, kv_heads, dim, dtype) -> None:
    generator = torch.Generator().manual_seed(21)
    # the same total rise (~87 in log2 units) however long the context
    cache, block_ids, q = _rising(context, q_len, heads, kv_heads, dim, 16, dtype, generator, rise=60.0 / context)
    got = kernel(q, cache, block_ids, context, 0.125).float()
    want = _reference(q, cache, block_ids, context, 0.125)
    # scores up to ~90: fp32's rounding of a score is ~5e-6 of its probability, and both this
    # kernel and fp32 SDPA land 2-5e-5 from a float64 reference at these sizes
    tolerance = {"rtol": 1e-5, "atol": 5e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-2}
    torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_query_row_keeps_its_own_running_maximum(kernel, dtype) -> None:
    """Neighbouring queries whose scores differ ~10^4-fold (hundreds in log2 units against
    a few): a row offset by another row's maximum overflows or underflows to no sum at all,
    which a shift-invariant softmax would otherwise hide."""
    generator = torch.Generator().manual_seed(5)
    cache, block_ids = _paged(90, 3, 64, 16, dtype, generator)
    q = torch.randn(40, 9, 64, generator=generator)
    q[0::2] *= 100.0
    q[1::2] *= 0.01
    q = q.to(dtype)
    got, want = kernel(q, cache, block_ids, 90, 0.125).float(), _reference(q, cache, block_ids, 90, 0.125)
    assert torch.isfinite(got).all()
    # scores in the hundreds: fp32's rounding of one is ~1e-5 of its probability
    tolerance = {"rtol": 1e-4, "atol": 5e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-2}
    torch.testing.assert_close(got, want, **tolerance)


def test_queries_may_be_a_view_into_the_fused_projection(kernel) -> None:
    """q comes in as a slice of the qkv projection: its token stride is not heads * dim."""
    generator = torch.Generator().manual_seed(3)
    cache, block_ids = _paged(50, 2, 64, 16, torch.float32, generator)
    qkv = torch.randn(20, (6 + 2 * 2) * 64, generator=generator)
    q = qkv[:, : 6 * 64].view(20, 6, 64)
    assert q.stride(0) != 6 * 64 and kernel.takes(q, cache)
    torch.testing.assert_close(kernel(q, cache, block_ids, 50, 0.125), _reference(q.contiguous(), cache, block_ids, 50, 0.125))


def test_the_kernel_writes_the_rows_it_is_given(kernel) -> None:
    """`out` (the step's output rows, any token stride) is written in place, the rest of its
    buffer untouched; rows of another shape, dtype or layout are refused, nothing written."""
    generator = torch.Generator().manual_seed(4)
    cache, block_ids = _paged(40, 3, 64, 16, torch.float32, generator)
    q = torch.randn(24, 9, 64, generator=generator)
    wide = torch.full((24, 10 * 64), 7.0)
    out = wide[:, : 9 * 64].view(24, 9, 64)
    assert kernel(q, cache, block_ids, 40, 0.125, out).data_ptr() == out.data_ptr()
    assert torch.equal(out, kernel(q, cache, block_ids, 40, 0.125))
    assert (wide[:, 9 * 64 :] == 7.0).all()
    for bad in (torch.zeros(23, 9, 64), torch.zeros(24, 9, 64, dtype=torch.bfloat16),
                torch.zeros(24, 64, 9).transpose(1, 2)):
        with pytest.raises(ValueError, match="prefill attention writes"):
            kernel(q, cache, block_ids, 40, 0.125, bad)
        assert not bad.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 128)])
def test_a_steps_chunks_in_one_call_are_each_chunks_own_call(kernel, dtype, heads, kv_heads, dim) -> None:
    """The layer stack hands every prefill chunk of a step to one call (on AMX tiles, one
    parallel region for every chunk's tiles, the longest first): each chunk's rows are what a
    call of its own gives, bit for bit, whatever the chunks' sizes and cached prefixes, and the
    rows between chunks are left alone."""
    generator = torch.Generator().manual_seed(dim + heads)
    block = 16
    chunks = [(5, 5), (37, 100), (1, 1), (64, 64), (20, 300), (130, 130)]  # (queries, context)
    used = [-(-context // block) for _, context in chunks]
    blocks = sum(used) + 2
    cache = torch.full(kv_cache_shape(blocks, block, kv_heads, dim), float("nan"))
    order = torch.randperm(blocks, generator=generator)
    tables = torch.zeros(len(chunks), max(used), dtype=torch.int64)
    flat = cache.view(2, kv_heads, -1, dim)
    taken = 0
    for i, ((_, context), count) in enumerate(zip(chunks, used, strict=True)):
        ids = order[taken : taken + count]
        taken += count
        tables[i, :count] = ids
        slots = ids.repeat_interleave(block) * block + torch.arange(block).repeat(count)
        flat[:, :, slots[:context]] = torch.randn(2, kv_heads, context, dim, generator=generator)
    cache = cache.to(dtype)
    gap, starts, rows = 3, [], 0  # rows no chunk owns between chunks
    for q_len, _ in chunks:
        starts.append(rows)
        rows += q_len + gap
    fused = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    q = fused[:, : heads * dim].view(rows, heads, dim)  # a view into the fused projection
    out = torch.full((rows, heads, dim), 7.0, dtype=dtype)
    kernel.attend_spans(q, cache, tables, starts, [n for n, _ in chunks], [c for _, c in chunks], dim**-0.5, out)
    for i, (q_len, context) in enumerate(chunks):
        alone = kernel(q[starts[i] : starts[i] + q_len], cache, tables[i, : used[i]], context, dim**-0.5)
        assert torch.equal(out[starts[i] : starts[i] + q_len], alone), f"chunk {i}"
        assert (out[starts[i] + q_len : starts[i] + q_len + gap] == 7.0).all()


_GUARDED_READ = """
import ctypes, mmap, sys, torch
from tandem.kernels.cpu_prefill import PrefillAttentionKernel
from tandem.kernels.base import kv_cache_shape
kernel = PrefillAttentionKernel.build(__import__("pathlib").Path(sys.argv[1]))
libc = ctypes.CDLL(None)
page = mmap.PAGESIZE
region = mmap.mmap(-1, 2 * page)
base = ctypes.addressof(ctypes.c_char.from_buffer(region))
q_len, heads, dim = 5, 3, 48
size = q_len * heads * dim * 2
q = torch.frombuffer(region, dtype=torch.bfloat16, count=size // 2, offset=page - size).view(q_len, heads, dim)
q.copy_(torch.randn(q_len, heads, dim).bfloat16())
assert libc.mprotect(ctypes.c_void_p(base + page), page, 0) == 0  # the page after q: no access
cache = torch.randn(kv_cache_shape(1, 16, 1, dim)).bfloat16()
kernel(q, cache, torch.tensor([0]), q_len, dim ** -0.5)
print("read inside q")
"""


def test_the_queries_are_not_read_past_their_end(cache_dir) -> None:
    """With a head size of 16 x odd, the last block of bf16 pairs is half a block: reading it
    whole would read past the last head of the last token (here, into a page with no access)."""
    import sys

    result = subprocess.run([sys.executable, "-c", _GUARDED_READ, str(cache_dir)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and "read inside q" in result.stdout, result.stderr[-2000:]


def test_what_the_kernel_does_not_take(kernel) -> None:
    cache = torch.zeros(kv_cache_shape(2, 16, 1, 64))
    assert kernel.takes(torch.zeros(3, 2, 64), cache)
    assert not kernel.takes(torch.zeros(3, 2, 64, dtype=torch.bfloat16), cache)  # dtypes differ
    assert not kernel.takes(torch.zeros(3, 2, 64, dtype=torch.float16), cache.half())  # fp16
    assert not kernel.takes(torch.zeros(3, 2, 40), torch.zeros(kv_cache_shape(2, 16, 1, 40)))  # head size
    assert not kernel.takes(torch.zeros(3, 64, 2).transpose(1, 2), cache)  # dims not dense


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_bf16_is_left_to_pytorch_where_amx_multiplies_it_and_the_kernel_does_not(tmp_path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with AMX, PyTorch's flash attention (oneDNN on AMX's bf16 tiles) is 2.4-3.4x
    the AVX-512-BF16 lane tiles in bf16: a build without the kernel's own AMX path leaves bf16
    to it there (and keeps it elsewhere); fp32 stays here."""
    from tandem.platform.cpu_modes import CpuFeatures

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not CpuFeatures.detect().avx512_bf16:
        pytest.skip("needs a C compiler and a CPU with AVX-512-BF16")
    library = tmp_path / "prefill-cooperlake.so"
    subprocess.run([compiler, "-O3", "-march=cooperlake", "-fopenmp", "-shared", "-fPIC", "-std=c11",
                    str(cpu_prefill.SOURCE), "-o", str(library), "-lm"], check=True, capture_output=True)
    cache = torch.zeros(kv_cache_shape(2, 16, 1, 64))
    for flags, bf16 in (("avx512f avx512bw avx512_bf16", True),
                        ("avx512f avx512bw avx512_bf16 amx_tile amx_bf16 amx_int8", False)):
        monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls, *a, f=flags: cls.from_flags(f.split())))
        lanes = PrefillAttentionKernel(library)
        assert not lanes.amx and lanes.isa == "AVX-512-BF16 dot products"
        assert lanes.takes(torch.zeros(3, 2, 64), cache)
        assert lanes.takes(torch.zeros(3, 2, 64, dtype=torch.bfloat16), cache.bfloat16()) is bf16


@pytest.mark.skipif(not CpuFeatures.detect().amx, reason="AMX's bf16 tiles")
def test_with_amx_the_kernel_takes_bf16_on_its_tiles(kernel) -> None:
    """The kernel's AMX path takes bf16 head sizes of a multiple of 32 (the tiles' 32 values of
    k); others stay with PyTorch, which is faster there than the lane tiles."""
    assert kernel.amx and kernel.isa.startswith("AMX tiles")
    for dim, taken in ((64, True), (128, True), (32, True), (48, False)):
        cache = torch.zeros(kv_cache_shape(2, 16, 1, dim), dtype=torch.bfloat16)
        assert kernel.takes(torch.zeros(3, 2, dim, dtype=torch.bfloat16), cache) is taken


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_prefill_agrees_with_the_torch_backend(cache_dir, kernel, dtype) -> None:
    """A mixed step through the CPU backend: two decodes, a fresh prompt and a chunk after a
    cached prefix, against the torch backend on the same cache."""
    generator = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, block = 9, 3, 64, 16
    cache = torch.randn(kv_cache_shape(40, block, kv_heads, dim), generator=generator).to(dtype)
    fresh_ids, chunk_ids = torch.tensor([3, 4]), torch.tensor([10, 11, 12, 13, 14])
    spans = [PrefillSpan(2, 30, 30, fresh_ids), PrefillSpan(32, 20, 75, chunk_ids)]
    tables = torch.tensor([[20, 21], [30, 0]])
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), 2, tables, torch.tensor([20, 9]), 20, spans, block)
    total = 52
    q = torch.randn(total, heads, dim, generator=generator).to(dtype)
    # the fresh prompt's keys and values as the cache holds them (write_kv runs first)
    k = torch.zeros(total, kv_heads, dim, dtype=dtype)
    v = torch.zeros(total, kv_heads, dim, dtype=dtype)
    flat = cache.view(2, kv_heads, -1, dim)
    fresh_slots = (fresh_ids.repeat_interleave(block) * block + torch.arange(block).repeat(2))[:30]
    k[2:32], v[2:32] = flat[0][:, fresh_slots].transpose(0, 1), flat[1][:, fresh_slots].transpose(0, 1)
    decode = PagedDecodeKernel(build_kernel_library(cache_dir, cpu_attention.SOURCE))
    ours = CpuAttentionBackend(decode, kernel).attend(q, k, v, cache, meta, dim**-0.5)
    theirs = TorchAttentionBackend().attend(q, k, v, cache, meta, dim**-0.5)
    tolerance = {"rtol": 1e-5, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-2}
    torch.testing.assert_close(ours.float(), theirs.float(), **tolerance)


def _compile_for(tmp_path, march: str):
    """The kernel built for an older target than this CPU, as the CI's machines may be."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    library = tmp_path / f"prefill-{march}.so"
    subprocess.run([compiler, "-O3", f"-march={march}", "-fopenmp", "-ffast-math", "-fno-finite-math-only",
                    "-shared", "-fPIC", "-std=c11", str(cpu_prefill.SOURCE), "-o", str(library), "-lm"],
                   check=True, capture_output=True)
    return library


_OLDER_TARGETS = ["x86-64", "haswell",
                  # AVX-512 without its bf16 dot products, where this CPU runs it
                  *(["skylake-avx512"] if CpuFeatures.detect().avx512 else [])]


@pytest.mark.parametrize("march", ["native", *_OLDER_TARGETS])
def test_the_softmax_exponentials_keep_their_documented_accuracy(tmp_path, cache_dir, march) -> None:
    """2^x at each polynomial degree against float64, on every instruction-set path: degree 3
    (the bf16 probabilities) within 7.6e-5, 5 within 3.5e-6 and 7 within 1e-7, and 5 and 7
    exactly 1 at 0 (a correction for a maximum that stayed). A coefficient that is off scales
    the probabilities alike, which the attention's own tests cannot see after normalising."""
    if march != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 instruction sets")
    path = build_kernel_library(cache_dir, cpu_prefill.SOURCE) if march == "native" else _compile_for(tmp_path, march)
    probe = ctypes.CDLL(str(path)).tandem_exp2_probe
    x = torch.cat([torch.linspace(-40.0, 0.0, 160_000), -torch.arange(16.0), -torch.arange(16.0) - 1e-6])
    want = torch.exp2(x.double())
    for degree, bound in ((3, 7.6e-5), (5, 3.5e-6), (7, 1e-7)):
        got = torch.empty_like(x)
        probe(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(got.data_ptr()), ctypes.c_int64(x.numel()),
              ctypes.c_int(degree))
        error = (got.double() / want - 1).abs().max().item()
        assert error <= bound, f"degree {degree} on {march}: {error:.2e} relative"
        if degree > 3:
            assert got[160_000 - 1].item() == 1.0  # 2^0


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize("march", _OLDER_TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_instruction_set_path_computes_the_same(tmp_path, march, dtype) -> None:
    """The machines this runs on differ (AVX2-only EPYCs, AVX-512 Xeons): the vector code
    built for an older target (no bf16 dot products) against masked SDPA."""
    other = PrefillAttentionKernel(_compile_for(tmp_path, march))
    assert other.isa == "fp32 FMA (bf16 widened)"
    generator = torch.Generator().manual_seed(11)
    cache, block_ids = _paged(70, 2, 64, 16, dtype, generator)
    q = torch.randn(37, 6, 64, generator=generator).to(dtype)
    tolerance = {"rtol": 1e-5, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-2}
    torch.testing.assert_close(other(q, cache, block_ids, 70, 0.125).float(),
                               _reference(q, cache, block_ids, 70, 0.125), **tolerance)
    cache, block_ids, q = _rising(150, 37, 6, 2, 64, 16, dtype, generator)
    if dtype == torch.float32:
        tolerance["atol"] = 1e-5  # scores up to ~65: as in test_scores_that_keep_rising_along_the_context
    torch.testing.assert_close(other(q, cache, block_ids, 150, 0.125).float(),
                               _reference(q, cache, block_ids, 150, 0.125), **tolerance)
