"""Decode attention over the paged cache against a dense reference, including the split path."""

from __future__ import annotations

import torch

from tandem.kernels.base import AttentionMetadata, kv_cache_shape
from tandem.kernels.torch_attention import TorchAttentionBackend

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
