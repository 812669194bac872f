"""One mixed attention step for a backend against the torch reference: the case the
interpreted Triton tests (tests/kernels/gpu/test_gpu_kernels.py), the compiled ones on a GPU
(test_on_gpu.py) and the C kernels' (tests/kernels/test_kv_fp8.py) all run, so the GPU checks
the very step CI checks on the CPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels.base import AttentionMetadata, PrefillSpan, kv_cache_shape
from tandem.kernels.gpu.backend import TritonAttentionBackend
from tandem.kernels.kv_format import quantize_rows
from tandem.kernels.torch_attention import TorchAttentionBackend


@dataclass
class MixedStep:
    """What the backend under test produced (`got`, `cache`, on the device) and what the torch
    backend produced over the same inputs on the CPU in fp32 (`want`, `reference_cache`)."""

    got: torch.Tensor
    want: torch.Tensor
    cache: torch.Tensor
    reference_cache: torch.Tensor


def one_query_reference(q: torch.Tensor, widened: torch.Tensor, table: torch.Tensor, length: int, kv_heads: int,
                        dim: int, scale: float) -> torch.Tensor:
    """One decode query [heads, dim] in fp32 over `length` tokens of one sequence, read through
    its block table from a cache already widened to fp32 ([2, kv_heads, blocks, block, dim]):
    dense softmax attention, the query heads of a KV head sharing it (GQA)."""
    keys = widened[0][:, table].reshape(kv_heads, -1, dim)[:, :length]  # [kv_heads, length, dim]
    values = widened[1][:, table].reshape(kv_heads, -1, dim)[:, :length]
    group = q.shape[0] // kv_heads
    k, v = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    probs = torch.softmax((q.unsqueeze(1) @ k.transpose(1, 2)) * scale, dim=-1)
    return (probs @ v).squeeze(1)


def scattered_tables(contexts: list[int], block_size: int, blocks: int, generator: torch.Generator) -> torch.Tensor:
    """Each sequence's block table: distinct blocks, scattered over the cache (not in order)."""
    width = max(-(-c // block_size) for c in contexts)
    order = torch.randperm(blocks, generator=generator)
    tables = torch.zeros(len(contexts), width, dtype=torch.int64)
    used = 0
    for i, context in enumerate(contexts):
        n = -(-context // block_size)
        tables[i, :n] = order[used: used + n]
        used += n
    return tables


def mixed_step(dtype: torch.dtype, kv: str, heads: int, kv_heads: int, dim: int, block_size: int,
               device: str = "cpu", backend: object | None = None) -> MixedStep:
    """Two decodes, then three prefill chunks: a fresh prompt, a chunk after a cached prefix
    that ends mid-block, and a one-token chunk; the step's K/V written by each backend. `kv`:
    `auto` (the cache in `dtype`), `fp8` (float8 e4m3: both sides attend over the same rounded
    values) or `int8` (rotated int8 rows and their scales: the reference attends over the
    dequantized rows). `backend`: the one under test (the Triton backend where None)."""
    generator = torch.Generator().manual_seed(7)
    torch.manual_seed(dim + block_size)
    decode_contexts = [block_size + 3, 2]
    chunks = [(0, 5), (block_size + 9, 2 * block_size + 2), (70, 1)]  # (cached, q_len)
    contexts = decode_contexts + [cached + q_len for cached, q_len in chunks]
    blocks = sum(-(-c // block_size) for c in contexts) + 2
    cache = torch.randn(kv_cache_shape(blocks, block_size, kv_heads, dim), dtype=dtype)
    tables = scattered_tables(contexts, block_size, blocks, generator)
    rows = len(decode_contexts) + sum(q_len for _, q_len in chunks)
    query = torch.randn(rows, heads, dim, dtype=dtype)
    key = torch.randn(rows, kv_heads, dim, dtype=dtype)
    value = torch.randn(rows, kv_heads, dim, dtype=dtype)
    slots, spans, start = [], [], len(decode_contexts)
    for i, c in enumerate(decode_contexts):  # a decode's token is the last of its context
        slots.append(int(tables[i, (c - 1) // block_size]) * block_size + (c - 1) % block_size)
    for j, (cached, q_len) in enumerate(chunks):
        row = len(decode_contexts) + j
        table = tables[row, : -(-(cached + q_len) // block_size)]
        spans.append(PrefillSpan(start, q_len, cached + q_len, table))
        slots += [int(table[p // block_size]) * block_size + p % block_size for p in range(cached, cached + q_len)]
        start += q_len
    scale = dim ** -0.5
    if kv == "fp8":
        cache = cache.to(torch.float8_e4m3fn)
    elif kv == "int8":
        cache = quantize_rows(cache)
    reference_cache = cache.clone() if kv == "int8" else cache.float().clone()

    def metadata(on: str) -> AttentionMetadata:
        return AttentionMetadata(torch.tensor(slots, device=on), len(decode_contexts), tables[:2].to(on),
                                 torch.tensor(decode_contexts, device=on), max(decode_contexts),
                                 spans, block_size)  # spans' block ids stay on the host, as the runner's

    tested = backend if backend is not None else TritonAttentionBackend(target_programs=16)  # splits the 2 decodes
    on_device = [t.to(device) for t in (query, key, value, cache)]
    if isinstance(tested, TritonAttentionBackend):
        tested.check(on_device[3])
    meta = metadata(device)
    tested.write_kv(on_device[1], on_device[2], on_device[3], meta)
    got = tested.attend(*on_device[:3], on_device[3], meta, scale)
    torch_backend = TorchAttentionBackend()
    stored = (lambda x: x.to(cache.dtype).float()) if kv == "fp8" else (lambda x: x.float())
    reference_meta = metadata("cpu")
    torch_backend.write_kv(stored(key), stored(value), reference_cache, reference_meta)
    want = torch_backend.attend(query.float(), stored(key), stored(value), reference_cache, reference_meta, scale)
    return MixedStep(got, want, on_device[3], reference_cache)


def assert_stored_as_the_reference(step: MixedStep, kv: str, dim: int) -> None:
    """The backend under test stored the reference's bytes: exactly for a float or fp8 cache; for
    int8 rows the scales to a few units in the last place and the levels to one apart, on at
    most 1% of values (its write kernel rotates each run with a dot whose sums run in another
    order than torch's product, so a value on a rounding boundary may land on either side)."""
    cache = step.cache.cpu()
    if kv != "int8":
        assert torch.equal(cache.float(), step.reference_cache)
        return
    levels = cache[..., :dim].contiguous().view(torch.int8).int()
    want = step.reference_cache[..., :dim].contiguous().view(torch.int8).int()
    assert (levels - want).abs().max() <= 1 and (levels != want).float().mean() < 0.01
    torch.testing.assert_close(cache[..., dim:].contiguous().view(torch.float32),
                               step.reference_cache[..., dim:].contiguous().view(torch.float32), rtol=1e-6, atol=0)
