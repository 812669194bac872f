"""How a KV cache row is stored: in a float dtype as is, or as 8-bit integers with their scale.

(A float8 e4m3 cache, --kv-cache-dtype fp8, is a float dtype stored as is: each value divided
by its layer's power-of-two scale (tandem/layers/attention.py), clamped to e4m3's 448 and
rounded to nearest even, as vLLM's saturating cast; `to_fp8`. Its rows are head_dim bytes.)

`--kv-cache-dtype int8` keeps each (token, kv head) row of keys or values as `head_dim` int8
values rounded against the row's largest magnitude, followed by that row's fp32 scale: one
row is `head_dim + 4` bytes (68 for a 64-wide head, against 128 in bf16 and 256 in fp32). The
scale sits inside the row, not in a tensor beside the cache, so everything that moves or
copies whole blocks (the prefix cache, the KV connectors, the tiers) moves the scales with
them without knowing about them, and a kernel reading a row finds its scale at a fixed offset.

A per-row scale follows the values as they are written, one token at a time: nothing is
calibrated and nothing is re-quantized when a block fills (KIVI and vLLM's per-token
quantization take the same unit for keys' and values' rows on CPUs).

Before rounding, each run of `ROTATION_GROUP` values of a row is rotated by the normalized
Hadamard matrix (QuaRot's trick, the one the int8 and int4 codecs use): a few large channels,
which Qwen2.5's keys have, would otherwise take the row's scale and round every other channel
to a handful of levels. Rotated, their weight is spread over the run. On Qwen2.5-Coder-0.5B
this took the int8 cache from +2.90% perplexity to +0.64% (SmolLM2: +0.12% to +0.06%). The
stored values stay rotated: `dequantize_rows` rotates back (the matrix is its own inverse), and
the C decode kernel reads them as they are with a rotated query, since q.k = Rq.Rk, and
rotates its output, a weighted sum of rotated values, back after it. The C kernel and writer
rotate with butterflies (csrc/paged_decode_attention.c), torch with a matmul: the same
rotation to a few units in the last place.

The cache tensor is uint8 of shape [planes, kv_heads, num_blocks, block_size, head_dim + 4]
(tandem/kernels/base.py: kv_cache_shape with the stored row width).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from tandem.config import KV_INT8_SCALE_BYTES

INT8_SCALE_BYTES = KV_INT8_SCALE_BYTES  # one fp32 per row
FP8 = torch.float8_e4m3fn  # --kv-cache-dtype fp8
FP8_MAX = 448.0  # float8 e4m3's largest finite value
_INT8_MAX = 127.0
ROTATION_GROUP = 64  # values rotated together along the head dimension


def is_int8_cache(kv_cache: torch.Tensor) -> bool:
    """Whether `kv_cache` holds int8 rows with inline scales (its dtype is uint8)."""
    return kv_cache.dtype == torch.uint8


def is_fp8_cache(kv_cache: torch.Tensor) -> bool:
    """Whether `kv_cache` holds float8 e4m3 values (--kv-cache-dtype fp8)."""
    return kv_cache.dtype == FP8


def rounds_on_write(kv_cache: torch.Tensor) -> bool:
    """Whether writing into `kv_cache` rounds what it keeps (int8 or fp8): attention over a
    chunk's own keys must then read them back from the cache, as a prefix-cache hit will,
    not use the exact ones it was given."""
    return kv_cache.dtype in (torch.uint8, FP8)


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Values (already divided by their scale) as float8 e4m3: clamped to +-448 first, since
    torch's cast makes NaN of what does not fit, then rounded to nearest even."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def stored_row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of `kv_dtype` one cached row takes: the head size, plus the scale's bytes for
    an int8 cache."""
    return head_dim + INT8_SCALE_BYTES if kv_dtype == torch.uint8 else head_dim


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The head size a cache's rows hold (its last dimension, less an int8 row's scale)."""
    width = kv_cache.shape[-1]
    return width - INT8_SCALE_BYTES if is_int8_cache(kv_cache) else width


def rotation_size(head_dim: int) -> int:
    """Values rotated together: ROTATION_GROUP where the head dimension is a multiple of it,
    else the whole head where that is a power of two, else none (0: rows stay as they are)."""
    if head_dim % ROTATION_GROUP == 0:
        return ROTATION_GROUP
    return head_dim if head_dim & (head_dim - 1) == 0 else 0


def rotate_runs(runs: torch.Tensor) -> torch.Tensor:
    """Each run (the last dimension, a power of two long) times the normalized
    Sylvester-Hadamard matrix of its length: orthonormal and its own inverse."""
    return runs @ hadamard(runs.shape[-1], runs.dtype, runs.device)


def rotate_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., head_dim] with each run of `rotation_size(head_dim)` values rotated (a new
    tensor; the rows as they are where the head dimension has no rotation)."""
    size = rotation_size(x.shape[-1])
    if not size:
        return x.clone()
    return rotate_runs(x.reshape(*x.shape[:-1], -1, size)).reshape(x.shape)


@lru_cache(maxsize=16)
def hadamard(size: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalized Sylvester-Hadamard matrix of a power-of-two `size` (built once a size,
    dtype and device: it is taken twice a layer a step, and on a GPU the first step, before
    any CUDA graph is captured, builds it; callers must not write into it)."""
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < size:
        matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
    return (matrix / size**0.5).to(device=device, dtype=dtype)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., head_dim] of any float dtype -> uint8 rows [..., head_dim + 4]: the rotated
    row's int8 values rounded to nearest against its absolute maximum (which maps to 127),
    then the row's fp32 scale (0 for an all-zero row, which then reads back as zeros)."""
    x = rotate_rows(x.float())
    top = x.abs().amax(dim=-1, keepdim=True)
    scale = top / _INT8_MAX
    inverse = torch.where(top > 0, _INT8_MAX / top, torch.zeros_like(top))
    values = (x * inverse).round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    rows = torch.empty(*x.shape[:-1], x.shape[-1] + INT8_SCALE_BYTES, dtype=torch.uint8, device=x.device)
    rows[..., : x.shape[-1]] = values.view(torch.uint8)
    rows[..., x.shape[-1]:] = scale.contiguous().view(torch.uint8)
    return rows


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 rows [..., head_dim + 4] (quantize_rows) -> [..., head_dim] in `dtype`."""
    return rotate_rows(rotated_values(rows)).to(dtype)


def rotated_values(rows: torch.Tensor) -> torch.Tensor:
    """uint8 rows [..., head_dim + 4] -> their fp32 values as stored, still rotated."""
    head_dim = rows.shape[-1] - INT8_SCALE_BYTES
    values = rows[..., :head_dim].contiguous().view(torch.int8).float()
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return values * scale


def widen(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached rows as `dtype` for attention: dequantized from int8, else a cast (or nothing)."""
    return dequantize_rows(rows, dtype) if rows.dtype == torch.uint8 else rows.to(dtype)
