"""KV cache bytes per token on one rank.

GQA caches a key and a value vector per KV head per layer: 2 x kv_heads x head_dim values.
Tensor parallelism splits the KV heads over the ranks; when tp exceeds the KV heads every
rank keeps one (a replicated copy), so the per-rank figure stops shrinking there.
Llama-3.1-70B: 2 x 80 layers x 8 heads x 128 x 2 bytes = 320 KiB per token (40 KiB per rank
at tp 8).

MLA (DeepSeek-V3, Kimi-K2) caches one compressed latent per token per layer: kv_lora_rank +
qk_rope_head_dim values (512 + 64 = 576), shared by all heads, so tensor parallelism does not
shrink it: every rank holds the whole latent. Kimi-K2: 576 x 61 x 2 bytes = 68.6 KiB per token
on every rank.

Pipeline parallelism divides by layers: a stage caches only its own layers.

An int8 cache (`--kv-cache-dtype int8`, CPU backends) keeps each row (one head's key or value,
or MLA's latent) as int8 values followed by its fp32 scale: head_dim + 4 bytes a row, 68 for a
64-wide head against 128 in bf16 (0.53x).

Llama 4's chunked-attention layers (3 of every 4) could cap their cache at
attention_chunk_size tokens per sequence; the plan counts every layer in full, an upper bound.
"""

from __future__ import annotations

from tandem.sizing.shape import DTYPE_BYTES, ModelShape

KV_INT8_SCALE_BYTES = 4  # an int8 cache row's fp32 scale, after its values (kernels/kv_format.py)


def kv_rows_per_token_per_layer(shape: ModelShape, tp: int) -> int:
    """Cached rows per token per layer on the rank with the most KV heads (rank 0, when tp
    does not divide them): a key and a value per head, or MLA's one latent."""
    return 1 if shape.mla is not None else 2 * -(-shape.num_kv_heads // tp)


def kv_values_per_token_per_layer(shape: ModelShape, tp: int) -> int:
    """Cached values per token per layer on one rank."""
    if shape.mla is not None:
        return shape.mla.kv_lora_rank + shape.mla.qk_rope_head_dim
    return kv_rows_per_token_per_layer(shape, tp) * shape.head_dim


def kv_bytes_per_token(shape: ModelShape, tp: int, layers: int, kv_dtype: str) -> int:
    """KV bytes per token on one rank holding `layers` layers."""
    values = kv_values_per_token_per_layer(shape, tp)
    if kv_dtype == "int8":
        return (values + kv_rows_per_token_per_layer(shape, tp) * KV_INT8_SCALE_BYTES) * layers
    return values * layers * DTYPE_BYTES[kv_dtype]
