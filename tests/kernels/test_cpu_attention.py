"""The C decode-attention kernel against a dense reference, and how the backend is chosen."""

from __future__ import annotations

import logging
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tandem.kernels import c_library, cpu_attention
from tandem.kernels.attention_registry import make_attention_backend
from tandem.kernels.base import AttentionMetadata, kv_cache_shape
from tandem.kernels.c_library import KernelBuildError, build_kernel_library
from tandem.kernels.cpu_attention import (
    CpuAttentionBackend,
    PagedDecodeKernel,
)
from tandem.kernels.torch_attention import TorchAttentionBackend


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> PagedDecodeKernel:
    return PagedDecodeKernel(build_kernel_library(tmp_path_factory.mktemp("cache"), cpu_attention.SOURCE))


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One query [H, D] over a dense [L, kv_heads, D] context, query heads grouped per kv head."""
    group = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    probs = torch.softmax((q.unsqueeze(1) @ k.transpose(1, 2)) * scale, dim=-1)
    return (probs @ v).squeeze(1)


@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads", "dim", "block"),
    [
        ([1], 9, 3, 64, 16),  # one token of context
        ([37], 9, 3, 64, 16),  # a lone stream: work split per query head
        ([5, 200, 17, 64, 3, 90], 9, 3, 64, 16),  # unsorted lengths, partial last blocks
        ([40] * 70, 9, 3, 64, 16),  # many sequences: work split per kv head
        ([7, 33, 12], 8, 8, 32, 4),  # no grouping (MHA), small blocks
        ([300, 129], 16, 2, 128, 32),  # wide heads, 8 query heads per kv head
        ([1000], 7, 1, 64, 16),  # a lone stream's long context: its keys cut into spans
        ([300], 32, 1, 32, 16),  # a group wider than an item takes: no spans
    ],
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_dense_reference(kernel, lengths, heads, kv_heads, dim, block, cache_dtype) -> None:
    _check_against_reference(kernel, lengths, heads, kv_heads, dim, block, cache_dtype)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize(("march", "isa", "flag"), [("haswell", "AVX2 fp32 FMA (bf16 widened)", "avx2"),
                                                    ("x86-64", "portable C", None)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_the_paths_without_avx512_compute_the_same(tmp_path, march, isa, flag, cache_dtype) -> None:
    """An AVX2 CPU takes the 8-keys-per-vector path, a plain x86-64 the per-key loops: each
    built for its target and checked against the same reference (partial groups of keys,
    blocks smaller than a group, one query head an item, wide heads)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    library = tmp_path / f"decode-{march}.so"
    subprocess.run([compiler, "-O3", f"-march={march}", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-shared",
                    "-fPIC", "-std=c11", str(cpu_attention.SOURCE), "-o", str(library), "-lm"],
                   check=True, capture_output=True)
    other = PagedDecodeKernel(library)
    assert other.isa == isa
    if flag is not None and flag not in Path("/proc/cpuinfo").read_text():
        pytest.skip(f"this CPU cannot run {flag} code")
    _check_against_reference(other, [5, 200, 17, 64, 3, 90], 9, 3, 64, 16, cache_dtype)
    _check_against_reference(other, [37], 9, 3, 64, 16, cache_dtype)
    _check_against_reference(other, [7, 33, 12], 8, 8, 32, 4, cache_dtype)
    _check_against_reference(other, [300, 129], 16, 2, 128, 32, cache_dtype)
    _check_against_reference(other, [1, 9, 40], 4, 1, 8, 16, cache_dtype)  # head size of one 8-lane vector
    _check_against_reference(other, [1000], 7, 1, 64, 16, cache_dtype)  # a lone stream's keys in spans


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_avx512_without_bf16_dot_products_widens_the_cache(tmp_path) -> None:
    """An AVX-512 Xeon without AVX-512-BF16 (Skylake, Cascade Lake) takes the widening vector
    path for bf16 queries too; built for that target, checked against the same reference."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    library = tmp_path / "decode-skylake.so"
    subprocess.run([compiler, "-O3", "-march=skylake-avx512", "-fopenmp", "-ffast-math", "-fno-finite-math-only",
                    "-shared", "-fPIC", "-std=c11", str(cpu_attention.SOURCE), "-o", str(library), "-lm"],
                   check=True, capture_output=True)
    other = PagedDecodeKernel(library)
    assert other.isa == "AVX-512 fp32 FMA (bf16 widened)"
    if "avx512f" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU cannot run AVX-512 code")
    _check_against_reference(other, [5, 200, 17, 64, 3, 90], 9, 3, 64, 16, torch.bfloat16, torch.bfloat16)
    _check_against_reference(other, [300, 129], 16, 2, 128, 32, torch.bfloat16)
    _check_against_reference(other, [1000], 7, 1, 64, 16, torch.bfloat16, torch.bfloat16)  # spans


@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads", "dim", "block"),
    [
        ([37], 9, 3, 64, 16),  # one query head a work item
        ([5, 200, 17, 64, 3, 90], 9, 3, 64, 16),  # partial groups and blocks, odd lengths
        ([40] * 70, 9, 3, 64, 16),  # three query heads an item
        ([7, 33, 12], 8, 8, 32, 4),  # blocks smaller than a group of 16 keys
        ([300, 129], 16, 2, 128, 32),  # wide heads, 8 query heads per kv head
        ([1000], 7, 1, 64, 16),  # a lone stream's long context: its keys cut into spans
    ],
)
def test_bf16_queries_over_a_bf16_cache(kernel, lengths, heads, kv_heads, dim, block) -> None:
    """What a bf16 model runs (on a CPU with AVX-512-BF16, the dot-product path: q and out
    stay bf16, keys are never widened): the fp32 reference over the same bf16 values, rounded
    once to bf16."""
    _check_against_reference(kernel, lengths, heads, kv_heads, dim, block, torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize(("group", "dim"), [(3, 64), (4, 64), (5, 64), (7, 64), (8, 64),
                                            (4, 128), (6, 128), (7, 128), (8, 128), (5, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_grouped_head_count_with_a_path_of_its_own(kernel, group, dim, dtype) -> None:
    """The fp32 vector path and the bf16 dot-product path have a build for each common (query
    heads a kv head, head size) pair (Llama 3's 4, Qwen2.5-1.5B's 6, Qwen2.5-0.5B's 7, ...),
    where the compiler keeps the group in registers, and one for any other count (5 here):
    with enough sequences for an item to take a kv head's whole group, every build against the
    reference."""
    _check_against_reference(kernel, [40] * 10 + [131, 5], 2 * group, 2, dim, 16, dtype, dtype)


@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads", "dim", "block"),
    [
        ([190], 9, 3, 64, 16),  # SmolLM2's lone stream: 3 pairs, fewer than two a thread
        ([1000, 3], 4, 1, 32, 4),  # a context shorter than a span, blocks smaller than a group
        ([129], 14, 2, 64, 16),  # Qwen2.5-Coder-0.5B's heads; the last span one key long
        ([4100], 14, 2, 64, 16),  # an agent's prompt
    ],
)
@pytest.mark.parametrize(("cache_dtype", "query_dtype"),
                         [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                          (torch.bfloat16, torch.bfloat16)])
def test_a_few_streams_keys_are_cut_into_spans_and_merged(kernel, lengths, heads, kv_heads, dim, block, cache_dtype,
                                                          query_dtype) -> None:
    """With fewer (sequence, kv head) pairs than two a thread, each pair's keys are split into
    spans, each span's output normalized over its own keys and the spans merged by their
    maxima and sums: the same attention as over the whole context at once (two threads, as
    the CI box and this rule's examples have)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check_against_reference(kernel, lengths, heads, kv_heads, dim, block, cache_dtype, query_dtype)
    finally:
        torch.set_num_threads(threads)


def test_the_decode_path_is_named(kernel) -> None:
    assert kernel.isa in ("AVX-512-BF16 dot products", "AVX-512 fp32 FMA (bf16 widened)",
                          "AVX2 fp32 FMA (bf16 widened)", "portable C")


def _check_against_reference(kernel, lengths, heads, kv_heads, dim, block, cache_dtype,
                             query_dtype=torch.float32) -> None:
    generator = torch.Generator().manual_seed(len(lengths) * 1000 + heads)
    per_seq = [-(-n // block) for n in lengths]
    num_blocks = sum(per_seq) + 3  # spare blocks nobody reads
    cache = torch.randn(kv_cache_shape(num_blocks, block, kv_heads, dim), generator=generator).to(cache_dtype)
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(lengths), max(per_seq), dtype=torch.long)  # padded with block 0
    used = 0
    for row, count in enumerate(per_seq):
        tables[row, :count] = order[used : used + count]
        used += count
    queries = torch.randn(len(lengths), heads, dim, generator=generator).to(query_dtype)
    scale = dim**-0.5
    got = kernel(queries, cache, tables, torch.tensor(lengths), scale)
    assert got.dtype == query_dtype
    cache = cache.float()  # bf16 widens to fp32 exactly: the same reference holds
    for row, length in enumerate(lengths):
        keys = cache[0][:, tables[row]].reshape(kv_heads, -1, dim)[:, :length].transpose(0, 1)
        values = cache[1][:, tables[row]].reshape(kv_heads, -1, dim)[:, :length].transpose(0, 1)
        want = _reference(queries[row].float(), keys, values, scale)
        if query_dtype == torch.float32:
            torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)
        else:  # one rounding to bf16 at the end: at most one unit in its last place apart
            torch.testing.assert_close(got[row].float(), want.bfloat16().float(), rtol=2**-7, atol=1e-5)


def test_backend_uses_the_kernel_for_fp32_and_bf16_and_torch_otherwise(kernel) -> None:
    generator = torch.Generator().manual_seed(1)
    cache = torch.randn(kv_cache_shape(8, 4, 2, 8), generator=generator)
    tables = torch.arange(8).view(2, 4)
    lengths = torch.tensor([9, 16])
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), 2, tables, lengths, 16, [], 4)
    queries = torch.randn(2, 4, 8, generator=generator)
    backend = CpuAttentionBackend(kernel)
    torch_backend = TorchAttentionBackend()
    torch.testing.assert_close(backend._decode(queries, cache, meta, 0.3), torch_backend._decode(queries, cache, meta, 0.3))
    bf16 = backend._decode(queries.bfloat16(), cache.bfloat16(), meta, 0.3)
    assert bf16.dtype == torch.bfloat16
    # fp32 arithmetic over the widened cache (the torch path's bf16 softmax is coarser)
    widened = torch_backend._decode(queries.bfloat16().float(), cache.bfloat16().float(), meta, 0.3)
    torch.testing.assert_close(bf16, widened.bfloat16())
    calls = []
    kernel_call = type(kernel).__call__
    try:
        type(kernel).__call__ = lambda self, *args: calls.append(args[1].dtype) or kernel_call(self, *args)
        backend._decode(queries.bfloat16(), cache.bfloat16(), meta, 0.3)
        half = backend._decode(queries.half(), cache.half(), meta, 0.3)  # not the kernel's dtype
    finally:
        type(kernel).__call__ = kernel_call
    assert calls == [torch.bfloat16]
    torch.testing.assert_close(half, torch_backend._decode(queries.half(), cache.half(), meta, 0.3))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_queries_as_bf16_views_into_the_projection_give_the_rounded_fp32_result(kernel, cache_dtype) -> None:
    """The model hands q straight from the fused qkv projection (a strided view, bf16 in a
    bf16 model): the kernel widens it itself and returns bf16 rounded from the same fp32
    result a dense fp32 query gets."""
    generator = torch.Generator().manual_seed(5)
    cache = torch.randn(kv_cache_shape(12, 16, 3, 64), generator=generator).to(cache_dtype)
    tables = torch.randperm(12, generator=generator)[:9].view(3, 3)
    lengths = torch.tensor([40, 3, 33])
    fused = torch.randn(3, (9 + 2 * 3) * 64, generator=generator).bfloat16()
    q = fused[:, : 9 * 64].view(3, 9, 64)
    assert kernel.takes_query(q) and not q.is_contiguous()
    got = kernel(q, cache, tables, lengths, 0.125)
    assert got.dtype == torch.bfloat16 and got.is_contiguous()
    dense = kernel(q.float().contiguous(), cache, tables, lengths, 0.125)
    assert torch.equal(got, dense.bfloat16())
    strided_fp32 = kernel(fused.float()[:, : 9 * 64].view(3, 9, 64), cache, tables, lengths, 0.125)
    assert torch.equal(strided_fp32, dense)


def test_a_step_of_decodes_only_returns_the_kernel_output(kernel) -> None:
    generator = torch.Generator().manual_seed(6)
    cache = torch.randn(kv_cache_shape(8, 4, 2, 16), generator=generator)
    tables = torch.arange(8).view(2, 4)
    lengths = torch.tensor([9, 16])
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), 2, tables, lengths, 16, [], 4)
    fused = torch.randn(2, 8 * 16, generator=generator)
    q, k, v = fused.split([4 * 16, 2 * 16, 2 * 16], dim=-1)
    q, k, v = q.view(2, 4, 16), k.view(2, 2, 16), v.view(2, 2, 16)
    got = CpuAttentionBackend(kernel).attend(q, k, v, cache, meta, 0.25)
    expected = TorchAttentionBackend().attend(q, k, v, cache, meta, 0.25)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_the_torch_path_for_views_into_a_fused_projection(kernel, dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, tokens = 6, 2, 8, 5
    # q, k and v side by side per token, as the fused qkv projection lays them out
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    qk, v = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
    k = qk.view(tokens, heads + kv_heads, dim)[:, heads:]
    v = v.view(tokens, kv_heads, dim)
    slots = torch.tensor([0, 5, 6, 17, 31])  # across blocks of 4, in any order
    meta = AttentionMetadata(slots, 0, torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 0, [], 4)
    ours = torch.randn(kv_cache_shape(8, 4, kv_heads, dim), generator=generator).to(dtype)
    theirs = ours.clone()
    CpuAttentionBackend(kernel).write_kv(k, v, ours, meta)
    TorchAttentionBackend().write_kv(k, v, theirs, meta)
    assert torch.equal(ours, theirs)
    flat = ours.view(2, kv_heads, -1, dim)
    assert torch.equal(flat[0, 1, 17], k[3, 1]) and torch.equal(flat[1, 0, 31], v[4, 0])


def test_no_compiler_falls_back_under_auto_and_fails_under_cpu(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setattr(c_library, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger="tandem.kernels.cpu_attention"):
        backend = make_attention_backend("auto", tmp_path)
    assert type(backend) is TorchAttentionBackend
    assert "no C compiler found" in caplog.text
    with pytest.raises(KernelBuildError, match="no C compiler found"):
        make_attention_backend("cpu", tmp_path)
    assert type(make_attention_backend("torch", tmp_path)) is TorchAttentionBackend
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_attention_backend("cuda", tmp_path)


def test_triton_on_a_cpu_needs_the_interpreter(monkeypatch, tmp_path) -> None:
    """--attention-backend triton on CPU tensors: a clear error, unless TRITON_INTERPRET=1
    (the tests' way of running the GPU kernels here)."""
    pytest.importorskip("triton", reason="triton comes with the test extras")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_attention_backend("triton", tmp_path)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert make_attention_backend("triton", tmp_path).name == "triton"
