"""`--attention-backend triton`: the attention backend interface over the Triton kernels.

Per step the runner's metadata is turned into the kernels' tensors once (the chunks' starts,
lengths, contexts and one padded block table) and kept in `meta.scratch` for every layer.
The step's keys and values are written into the cache first, so a prefill chunk reads its
whole context, cached prefix and fresh tokens alike, from the cache.

Under --kv-cache-dtype int8 (rows of int8 values and their scale, tandem/kernels/kv_format.py)
the write kernel rounds the step's keys and values into rows itself, with the arithmetic of
`quantize_rows` (the function every CPU path and connector uses; a head size the kernel does
not take is rounded by it in torch, and the bytes stored). One kernel a layer instead of a
dozen small torch ones: on an H200 those were ~1.3 ms of a 12.8 ms batch-1 step of
Llama-3.1-8B. The attention kernels read the rows as stored (rotated), and this backend
rotates the query before them and the output after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels.base import AttentionMetadata
from tandem.kernels.gpu import TRITON_CAPABILITIES, available
from tandem.kernels.gpu.cache_write import fused_int8_write, write_kv, write_kv_fp8, write_kv_int8
from tandem.kernels.gpu.decode_attention import decode_splits, paged_decode_attention
from tandem.kernels.gpu.prefill_attention import prefill_attention
from tandem.kernels.gpu.rotation import fused_rotation, rotate_heads
from tandem.kernels.kv_format import (
    FP8,
    INT8_SCALE_BYTES,
    is_int8_cache,
    quantize_rows,
    rotate_rows,
)

_SCRATCH_KEY = "triton"


@dataclass
class _Chunks:
    starts: torch.Tensor
    lens: torch.Tensor
    contexts: torch.Tensor
    tables: torch.Tensor
    max_len: int


class TritonAttentionBackend:
    name = "triton"
    capabilities = TRITON_CAPABILITIES

    def __init__(self, target_programs: int = 264) -> None:
        # Decode splits aim at this many programs: a couple per SM of an H100 (132 SMs).
        self.target_programs = target_programs

    @staticmethod
    def check(kv_cache: torch.Tensor) -> None:
        reason = available(kv_cache.device.type)
        if reason:
            raise RuntimeError(f"--attention-backend triton: {reason}")
        block_size = kv_cache.shape[3]
        if kv_cache.shape[0] != 2 or block_size < 16 or block_size & (block_size - 1):
            raise ValueError("--attention-backend triton needs a key and a value plane and a "
                             f"block size that is a power of two >= 16, got {tuple(kv_cache.shape)}")
        if is_int8_cache(kv_cache) and (kv_cache.shape[-1] - INT8_SCALE_BYTES) % 4:
            raise ValueError("--kv-cache-dtype int8 on --attention-backend triton needs a head size that is a "
                             f"multiple of 4 (its kernels read a row as 32-bit words), got {tuple(kv_cache.shape)}")

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        if kv_cache.dtype == FP8 and key.dtype != FP8:
            self.write_kv_scaled(key, value, kv_cache, meta, 1.0, 1.0)
            return
        if is_int8_cache(kv_cache) and key.dtype != torch.uint8:
            if fused_int8_write(key.shape[-1]):
                write_kv_int8(key, value, kv_cache, meta.slot_mapping)
                return
            key, value = quantize_rows(key), quantize_rows(value)
        write_kv(key, value, kv_cache, meta.slot_mapping)

    def write_kv_scaled(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                        meta: AttentionMetadata, key_multiplier: float, value_multiplier: float) -> None:
        """--kv-cache-dtype fp8: the keys and values times their multipliers (one over the
        layer's scales), rounded as torch's clamp to e4m3's finite range and cast round them
        (vLLM's saturating cast), stored as bytes, all in one kernel (cache_write.py)."""
        if kv_cache.dtype != FP8:
            raise ValueError(f"write_kv_scaled stores into an fp8 cache, not {kv_cache.dtype}")
        write_kv_fp8(key, value, kv_cache, meta.slot_mapping, key_multiplier, value_multiplier)

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        return _in_stored_rotation(self._attend, query, kv_cache, meta, scale)

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """The step's decode rows alone (MLA's absorbed decode calls this on its latent plane)."""
        return _in_stored_rotation(self._decode, query, kv_cache, meta, scale)

    def _attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        decodes = meta.num_decode_tokens
        decoded = None
        if decodes:
            decoded = self._decode(query[:decodes], kv_cache, meta, scale)
            if not meta.prefills:
                return decoded  # a decode-only step: no copy into a step-wide output
        out = torch.empty_like(query)
        if decoded is not None:
            out[:decodes] = decoded
        if meta.prefills:
            chunks = self._chunks(meta, query.device)
            prefill_attention(query, kv_cache, chunks.starts, chunks.lens, chunks.contexts,
                              chunks.tables, chunks.max_len, scale, out)
        return out

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        decodes = query.shape[0]
        max_blocks = -(-meta.decode_max_context_len // meta.block_size)
        splits = decode_splits(decodes, kv_cache.shape[1], max_blocks, self.target_programs)
        return paged_decode_attention(
            query, kv_cache, meta.decode_block_tables, meta.decode_context_lens,
            meta.decode_max_context_len, scale, splits,
        )

    @staticmethod
    def _chunks(meta: AttentionMetadata, device: torch.device) -> _Chunks:
        cached = meta.scratch.get(_SCRATCH_KEY)
        if cached is None:
            spans = meta.prefills
            width = max(len(s.block_ids) for s in spans)
            tables = torch.zeros(len(spans), width, dtype=torch.int64)
            for i, span in enumerate(spans):
                tables[i, : len(span.block_ids)] = span.block_ids
            cached = _Chunks(
                torch.tensor([s.q_start for s in spans], dtype=torch.int64, device=device),
                torch.tensor([s.q_len for s in spans], dtype=torch.int64, device=device),
                torch.tensor([s.context_len for s in spans], dtype=torch.int64, device=device),
                tables.to(device),
                max(s.q_len for s in spans),
            )
            meta.scratch[_SCRATCH_KEY] = cached
        return cached


def _in_stored_rotation(attend, query: torch.Tensor, kv_cache: torch.Tensor,  # noqa: ANN001
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """`attend(query, kv_cache, meta, scale)`, where an int8 cache's rows are stored rotated
    (kv_format.py): with the query rotated the same way before (q.k = Rq.Rk) and the output,
    a weighted sum of rotated values, rotated back after, one kernel each (gpu/rotation.py)
    where the head size allows, else in torch; a float cache's as it is."""
    if not is_int8_cache(kv_cache):
        return attend(query, kv_cache, meta, scale)
    if query.dim() == 3 and query.stride(2) == 1 and fused_rotation(query.shape[-1]):
        return rotate_heads(attend(rotate_heads(query), kv_cache, meta, scale))
    rotated = attend(rotate_rows(query.float()).to(query.dtype), kv_cache, meta, scale)
    return rotate_rows(rotated.float()).to(query.dtype)
