"""Reference attention backend in plain PyTorch, the CPU path.

Decodes are batched: every decode sequence's context is gathered from its block table into
one padded tensor and attended in a single batched matmul with a length mask. Prefill
chunks run one SDPA call each; a chunk with no cached context attends to its own fresh K/V
without touching the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.base import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        _, num_blocks, block_size, heads, dim = kv_cache.shape
        flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
        flat[0].index_copy_(0, meta.slot_mapping, key.to(kv_cache.dtype))
        flat[1].index_copy_(0, meta.slot_mapping, value.to(kv_cache.dtype))

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            out[:num_decodes] = self._decode(query[:num_decodes], kv_cache, meta, scale)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            out[rows] = self._prefill(query[rows], key[rows], value[rows], kv_cache, span, meta, scale)
        return out

    @staticmethod
    def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, block_size, heads, dim = kv_cache.shape
        keys = kv_cache[0, block_ids].reshape(-1, heads, dim)[:length]
        values = kv_cache[1, block_ids].reshape(-1, heads, dim)[:length]
        return keys, values

    def _prefill(self, q, k, v, kv_cache, span, meta, scale) -> torch.Tensor:
        cached = span.context_len - span.q_len
        if cached > 0:
            k, v = self._gather(kv_cache, span.block_ids, span.context_len)
            k, v = k.to(q.dtype), v.to(q.dtype)
            query_pos = torch.arange(cached, span.context_len).unsqueeze(1)
            mask = torch.arange(span.context_len).unsqueeze(0) <= query_pos
        else:
            mask = None
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)

    def _decode(self, q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_seqs, heads, dim = q.shape
        kv_heads = kv_cache.shape[3]
        group = heads // kv_heads
        max_blocks = -(-meta.decode_max_context_len // meta.block_size)
        tables = meta.decode_block_tables[:, :max_blocks]
        length = max_blocks * meta.block_size
        keys = kv_cache[0, tables].reshape(num_seqs, length, kv_heads, dim).permute(0, 2, 3, 1)
        values = kv_cache[1, tables].reshape(num_seqs, length, kv_heads, dim).transpose(1, 2)
        grouped = q.view(num_seqs, kv_heads, group, dim)
        scores = torch.matmul(grouped, keys.to(q.dtype)).float() * scale  # [S, kvh, g, L]
        pad = torch.arange(length).unsqueeze(0) >= meta.decode_context_lens.unsqueeze(1)
        scores.masked_fill_(pad.view(num_seqs, 1, 1, length), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, values.to(q.dtype)).view(num_seqs, heads, dim)
