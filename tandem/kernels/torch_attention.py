"""Reference attention backend in plain PyTorch, the CPU path.

Decodes are batched: every decode sequence's context is gathered from its block table, per
KV head, into one padded [kv_heads * seqs, tokens, head_dim] tensor and attended with two
batched matmuls and a length mask; the gather is the only pass over the cache. Prefill
chunks run one SDPA call each; a chunk with no cached context attends to its own fresh K/V
without touching the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.base import AttentionCapabilities, AttentionMetadata
from tandem.kernels.kv_format import (
    is_fp8_cache,
    is_int8_cache,
    quantize_rows,
    rounds_on_write,
    to_fp8,
    widen,
)

# Split a decode batch in two when it has at least this many sequences and the shorter half
# needs at most 1/this-factor of the blocks of the longest (i.e. saves >= 20% of its copy).
_SPLIT_MIN_SEQS = 8
_SPLIT_MIN_SAVING = 1.25


# PyTorch's CPU flash attention with its log-sum-exp (a private op; None where missing).
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _prefill_after_prefix(q: torch.Tensor, kv_cache: torch.Tensor, span, scale: float) -> torch.Tensor:
    """A chunk's attention over a cached prefix and itself, as two flash-attention calls
    merged by their log-sum-exps, instead of one call with an explicit causal mask (which
    PyTorch's CPU kernel runs 1.3-1.6x slower: 196 against 124 ms a layer for 2,048 queries
    after 2,048 cached tokens, fp32, 2 threads). Over the prefix no mask is needed, so the
    query heads of a KV group fold into one long query (no copy of the keys per head); over
    the chunk itself it is plain causal attention."""
    q_len, heads, dim = q.shape
    kv_heads = kv_cache.shape[1]
    group = heads // kv_heads
    cached = span.context_len - q_len
    width = kv_cache.shape[-1]  # the stored row: head_dim, or head_dim + its scale (int8)
    keys = widen(kv_cache[0][:, span.block_ids].reshape(kv_heads, -1, width)[:, : span.context_len], q.dtype)
    values = widen(kv_cache[1][:, span.block_ids].reshape(kv_heads, -1, width)[:, : span.context_len], q.dtype)
    by_group = q.reshape(q_len, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * q_len, dim)
    old, old_lse = _FLASH_WITH_LSE(by_group, keys[None, :, :cached], values[None, :, :cached], 0.0, False,
                                   scale=scale)[:2]
    old = old.reshape(kv_heads, group, q_len, dim).reshape(heads, q_len, dim)
    old_lse = old_lse.reshape(heads, q_len)
    new_keys = keys[:, cached:].repeat_interleave(group, 0)[None]  # the chunk's own: q_len tokens
    new_values = values[:, cached:].repeat_interleave(group, 0)[None]
    new, new_lse = _FLASH_WITH_LSE(q.transpose(0, 1)[None], new_keys, new_values, 0.0, True, scale=scale)[:2]
    new, new_lse = new[0], new_lse.reshape(heads, q_len)
    top = torch.maximum(old_lse, new_lse)
    w_old, w_new = (old_lse - top).exp_(), (new_lse - top).exp_()
    total = w_old + w_new
    out = old.float() * (w_old / total).unsqueeze(-1) + new.float() * (w_new / total).unsqueeze(-1)
    return out.to(q.dtype).transpose(0, 1)  # [q_len, heads, dim]


class TorchAttentionBackend:
    name = "torch"
    capabilities = AttentionCapabilities(latent_decode=True)

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        _, heads, num_blocks, block_size, width = kv_cache.shape
        flat = kv_cache.view(2, heads, num_blocks * block_size, width)
        if is_int8_cache(kv_cache):
            key, value = quantize_rows(key), quantize_rows(value)
        elif is_fp8_cache(kv_cache):  # as bytes: index_copy_ has no float8 kernel on a CPU
            key, value = to_fp8(key).view(torch.uint8), to_fp8(value).view(torch.uint8)
            flat = flat.view(torch.uint8)
        flat[0].index_copy_(1, meta.slot_mapping, key.transpose(0, 1).to(flat.dtype))
        flat[1].index_copy_(1, meta.slot_mapping, value.transpose(0, 1).to(flat.dtype))

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
            self._prefill(query[rows], key[rows], value[rows], kv_cache, span, scale, out[rows])
        return out

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        return self._decode(query, kv_cache, meta, scale)

    def _prefill(self, q, k, v, kv_cache, span, scale, out: torch.Tensor | None = None) -> torch.Tensor:
        """One prefill span's attention, written into `out` ([q_len, heads, dim], the step's
        output rows; a new tensor where None) and returned."""
        result = self._prefill_rows(q, k, v, kv_cache, span, scale)
        return result if out is None else out.copy_(result)

    def _prefill_rows(self, q, k, v, kv_cache, span, scale) -> torch.Tensor:
        cached = span.context_len - span.q_len
        if cached > 0 and _FLASH_WITH_LSE is not None:
            return _prefill_after_prefix(q, kv_cache, span, scale)
        q = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, dim]
        if cached > 0:
            _, heads, _, _, width = kv_cache.shape
            k = kv_cache[0][:, span.block_ids].reshape(heads, -1, width)[:, : span.context_len].unsqueeze(0)
            v = kv_cache[1][:, span.block_ids].reshape(heads, -1, width)[:, : span.context_len].unsqueeze(0)
            k, v = widen(k, q.dtype), widen(v, q.dtype)
            query_pos = torch.arange(cached, span.context_len).unsqueeze(1)
            mask = torch.arange(span.context_len).unsqueeze(0) <= query_pos
        elif rounds_on_write(kv_cache):
            # Attend to the rows the cache holds (write_kv ran first), as a prefix-cache hit
            # will. Quantizing k and v again here is not the same for int8: the C writer's
            # butterflies and torch's rotation sum in other orders, so a value on a rounding
            # boundary can land one step apart, and on a Zen EPYC 2 of 8 greedy continuations
            # then left the hit's.
            _, kv_heads, _, _, width = kv_cache.shape
            k = widen(kv_cache[0][:, span.block_ids].reshape(kv_heads, -1, width)[:, : span.context_len], q.dtype)
            v = widen(kv_cache[1][:, span.block_ids].reshape(kv_heads, -1, width)[:, : span.context_len], q.dtype)
            k, v, mask = k.unsqueeze(0), v.unsqueeze(0), None
        else:
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            mask = None
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        return out.squeeze(0).transpose(0, 1)

    def _decode(self, q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_seqs, heads, dim = q.shape
        kv_heads, width = kv_cache.shape[1], kv_cache.shape[-1]
        max_blocks = -(-meta.decode_max_context_len // meta.block_size)
        tables = meta.decode_block_tables[:, :max_blocks]
        length = max_blocks * meta.block_size
        if num_seqs == 1:
            # A single stream has no padding to mask: one SDPA call instead of ~15 small ops,
            # which is what a one-token step's time goes to once the GEMVs are fast.
            context = meta.decode_max_context_len
            keys = kv_cache[0][:, tables[0]].view(1, kv_heads, length, width)[:, :, :context]
            values = kv_cache[1][:, tables[0]].view(1, kv_heads, length, width)[:, :, :context]
            out = F.scaled_dot_product_attention(
                q.view(1, heads, 1, dim), widen(keys, q.dtype), widen(values, q.dtype), scale=scale, enable_gqa=True
            )
            return out.view(1, heads, dim)
        lens = meta.decode_context_lens
        if num_seqs >= _SPLIT_MIN_SEQS:
            # The runner orders decodes by context length, so the shorter half can be padded
            # to its own longest context instead of the batch's: less of the cache to copy.
            half = num_seqs // 2
            short_blocks = -(-int(lens[half - 1]) // meta.block_size)
            if short_blocks * _SPLIT_MIN_SAVING <= max_blocks:
                return torch.cat((
                    self._decode_padded(q[:half], kv_cache, tables[:half, :short_blocks], lens[:half], meta, scale),
                    self._decode_padded(q[half:], kv_cache, tables[half:], lens[half:], meta, scale),
                ))
        return self._decode_padded(q, kv_cache, tables, lens, meta, scale)

    @staticmethod
    def _decode_padded(q, kv_cache, tables, lens, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Decode attention for sequences padded to `tables.shape[1]` blocks."""
        num_seqs, heads, dim = q.shape
        kv_heads, width = kv_cache.shape[1], kv_cache.shape[-1]
        group = heads // kv_heads
        length = tables.shape[1] * meta.block_size
        # [kv_heads, seqs, max_blocks, block, dim] -> [kv_heads * seqs, length, dim], contiguous
        keys = widen(kv_cache[0][:, tables].view(kv_heads * num_seqs, length, width), q.dtype)
        values = widen(kv_cache[1][:, tables].view(kv_heads * num_seqs, length, width), q.dtype)
        grouped = q.view(num_seqs, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads * num_seqs, group, dim)
        scores = torch.bmm(grouped, keys.transpose(1, 2)).float() * scale  # [kvh * S, g, L]
        pad = torch.arange(length).unsqueeze(0) >= lens.unsqueeze(1)  # [S, L]
        scores = scores.view(kv_heads, num_seqs, group, length).masked_fill_(pad.view(1, num_seqs, 1, length), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(kv_heads * num_seqs, group, length)
        out = torch.bmm(probs, values)  # [kvh * S, g, dim]
        return out.view(kv_heads, num_seqs, group, dim).transpose(0, 1).reshape(num_seqs, heads, dim)
