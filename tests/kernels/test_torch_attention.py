"""Decode attention over the paged cache against a dense reference, including the split path."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.base import AttentionMetadata, PrefillSpan, kv_cache_shape
from tandem.kernels.torch_attention import (
    _FLASH_WITH_LSE,
    TorchAttentionBackend,
    _prefill_after_prefix,
)

BLOCK, KV_HEADS, HEADS, DIM = 4, 2, 6, 8


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query over a dense [L, kv_heads, dim] context, heads grouped over kv heads."""
    k = keys.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
    probs = torch.softmax((q.unsqueeze(1) @ k.transpose(1, 2)) * DIM**-0.5, dim=-1)
    return (probs @ v).squeeze(1)


def test_decode_matches_dense_reference_with_and_without_split() -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 4, 5, 6, 7, 8, 30, 31, 33, 40]  # short half ~8, long half ~40: the batch splits
    blocks_each = -(-max(lengths) // BLOCK)
    cache = torch.randn(kv_cache_shape(blocks_each * len(lengths), BLOCK, KV_HEADS, DIM), generator=generator)
    order = torch.randperm(blocks_each * len(lengths), generator=generator)
    tables = order.view(len(lengths), blocks_each)
    queries = torch.randn(len(lengths), HEADS, DIM, generator=generator)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        num_decode_tokens=len(lengths),
        decode_block_tables=tables,
        decode_context_lens=torch.tensor(lengths),
        decode_max_context_len=max(lengths),
        prefills=[],
        block_size=BLOCK,
    )
    backend = TorchAttentionBackend()
    got = backend._decode(queries, cache, meta, DIM**-0.5)
    for row, length in enumerate(lengths):
        flat_k = cache[0][:, tables[row]].reshape(KV_HEADS, -1, DIM)[:, :length].transpose(0, 1)
        flat_v = cache[1][:, tables[row]].reshape(KV_HEADS, -1, DIM)[:, :length].transpose(0, 1)
        torch.testing.assert_close(got[row], _reference(queries[row], flat_k, flat_v), rtol=1e-5, atol=1e-5)
    # the single-stream path agrees too
    single = AttentionMetadata(meta.slot_mapping, 1, tables[-1:], torch.tensor(lengths[-1:]), lengths[-1], [], BLOCK)
    torch.testing.assert_close(backend._decode(queries[-1:], cache, single, DIM**-0.5)[0], got[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (14, 2)])
@pytest.mark.parametrize(("cached", "q_len"), [(16, 16), (37, 21), (300, 1), (1000, 130)])
def test_a_chunk_after_a_cached_prefix_equals_one_masked_attention(
    dtype: torch.dtype, heads: int, kv_heads: int, cached: int, q_len: int
) -> None:
    """Two flash-attention calls (over the prefix, then causal over the chunk) merged by their
    log-sum-exps give what one SDPA call with the causal mask gives; the queries are a view
    into a fused projection, as the model passes them."""
    if _FLASH_WITH_LSE is None:
        pytest.skip("this torch has no CPU flash attention with log-sum-exp")
    torch.manual_seed(cached + q_len + heads)
    dim, block_size = 64, 16
    context = cached + q_len
    blocks = -(-context // block_size)
    cache = torch.randn(kv_cache_shape(blocks + 3, block_size, kv_heads, dim), dtype=dtype)
    block_ids = torch.randperm(blocks + 3)[:blocks]
    fused = torch.randn(q_len, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q = fused[:, : heads * dim].view(q_len, heads, dim)
    scale = dim ** -0.5
    got = _prefill_after_prefix(q, cache, PrefillSpan(0, q_len, context, block_ids), scale)
    keys = cache[0][:, block_ids].reshape(kv_heads, -1, dim)[:, :context].float()
    values = cache[1][:, block_ids].reshape(kv_heads, -1, dim)[:, :context].float()
    mask = torch.arange(context).unsqueeze(0) <= torch.arange(cached, context).unsqueeze(1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, scale=scale, enable_gqa=True
    )[0].transpose(0, 1)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)
