"""Power-of-two key divisors, folded into the attention's weights at load, so that cached keys
have evener channels and an int8 cache rounds them well.

Qwen2.5's keys have a few channels far larger than the rest (its attention has a bias on K):
an int8 cache row, even Hadamard-rotated, then leaves the rest few levels, +0.66% perplexity
on Qwen2.5-Coder-0.5B against the 0.5% bar. Dividing key channel c by s_c and multiplying the
query's channel c by s_c leaves every score as it was (q.k = (q*s).(k/s)), while the cache
holds k/s. s here is:

- derived from the weights, not from text, so every host that loads the checkpoint finds the
  same one: a rope pair's expected key size m = sqrt(sum over its two channels of
  b_c^2 + |W_c * gamma|^2) (W_c: the key row, gamma: the layer's input norm, b_c: the key
  bias), and s = 2^round(log2(m / median m over the head's pairs) / 2), within 2^-6..2^6.
  Simulated on Qwen2.5-Coder-0.5B's int8 keys: +0.17% (none: +0.74%; docs/performance.md);
- equal within each rope pair (channels i and i + head_dim / 2, the rotate-half form), so it
  commutes with RoPE and goes into W_k and b_k (divided) and W_q and b_q (multiplied) before
  anything is laid out for the kernels: no kernel and no step does anything more;
- a power of two, so every scaling is exact in floating point: a float cache's attention is
  bitwise what it was (the rows and scores are scaled exactly, the products q_c k_c are the
  same numbers), and so are the model's outputs.

Every cache, of any dtype, then holds k/s. The KV layout a worker declares carries the
divisors' digest (`KVLayout.key_divisors`), so a worker whose cache holds other keys (another
build, or a host that computed another s) refuses its rows instead of misreading them.

Left as they are (s = 1): attention with per-head q/k norms (Qwen3: the norm would undo s),
multi-head latent attention (its cache holds a latent, not keys), and query/key projections
kept in a checkpoint's 4-bit levels (whose rows are not plain floats to scale).
"""

from __future__ import annotations

import torch
import xxhash
from torch import nn

from tandem.models.llama import DecoderAttention, DecoderLayer

MAX_EXPONENT = 6  # s within 2^-6..2^6: outliers far beyond are left partly in place


def key_divisor_exponents(key_rows: torch.Tensor, key_bias: torch.Tensor | None, gamma: torch.Tensor,
                          head_dim: int) -> torch.Tensor:
    """Exponents e (s = 2^e), int64 [kv_heads, head_dim] and equal within each rope pair, for
    key projection rows [kv_heads * head_dim, hidden], their bias and the input norm's weight."""
    rows = key_rows.detach().double() * gamma.detach().double()
    energy = rows.square().sum(dim=1)
    if key_bias is not None:
        energy = energy + key_bias.detach().double().square()
    by_head = energy.view(-1, head_dim)
    half = head_dim // 2
    pair = (by_head[:, :half] + by_head[:, half:]).sqrt()
    median = pair.median(dim=1, keepdim=True).values.clamp_min(torch.finfo(torch.float64).tiny)
    ratio = (pair / median).clamp_min(torch.finfo(torch.float64).tiny)
    exponents = torch.round(torch.log2(ratio) / 2).clamp(-MAX_EXPONENT, MAX_EXPONENT).long()
    return torch.cat((exponents, exponents), dim=1)


def fold_key_divisors(model: nn.Module) -> str:
    """Fold each eligible layer's divisors into its qkv projection, in place, before the
    weights are laid out for kernels; returns their digest ("" where no layer took any)."""
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None:
        return ""
    digest = xxhash.xxh3_64()
    folded = 0
    for index, layer in enumerate(layers):
        if not isinstance(layer, DecoderLayer) or not isinstance(layer.self_attn, DecoderAttention):
            continue
        exponents = _fold_layer(layer.self_attn, layer.input_layernorm.weight)
        if exponents is None:
            continue
        digest.update(index.to_bytes(4, "little") + exponents.to(torch.int8).cpu().numpy().tobytes())
        folded += 1
    return digest.hexdigest() if folded else ""


def _fold_layer(attention: nn.Module, gamma: torch.Tensor) -> torch.Tensor | None:
    """The layer's exponents after scaling its query rows by s and key rows by 1/s (None: the
    layer is left as it is)."""
    projection = attention.qkv_proj
    weight = projection.weight
    if attention.q_norm is not None or projection.int4 is not None or weight.dim() != 2 or weight.numel() == 0:
        return None
    head_dim, q_size, kv_size = attention.head_dim, attention.q_size, attention.kv_size
    if head_dim % 2:
        return None
    bias = getattr(projection, "bias", None)
    keys = slice(q_size, q_size + kv_size)
    exponents = key_divisor_exponents(weight[keys], None if bias is None else bias[keys], gamma, head_dim)
    if not exponents.any():
        return exponents
    group = attention.num_heads // attention.num_kv_heads
    key_scale = torch.exp2(-exponents.double()).reshape(-1)  # [kv_heads * head_dim]
    query_scale = torch.exp2(exponents.double()).repeat_interleave(group, dim=0).reshape(-1)
    with torch.no_grad():
        for target in (weight, bias):
            if target is None:
                continue
            scales = (query_scale, key_scale)
            for part, scale in zip((slice(0, q_size), keys), scales, strict=True):
                rows = target.data[part]
                shape = (-1,) + (1,) * (rows.dim() - 1)
                rows.mul_(scale.to(device=rows.device, dtype=rows.dtype).view(shape))
    return exponents
