"""KV blocks as bytes for the wire and the tiers: as they are, or in 8 or 4 bits with scales.

A prefill worker hands its prompt's KV to a decode worker, and the tiers keep it in host
memory, on disk or in a cluster store; both move every layer's keys and values of every
block, so their bytes are the cache's bytes (a 4,096-token prefix of the 135M default model is
189 MB in fp32). A codec turns a tensor of blocks ([layers, planes, kv heads, blocks,
block size, head dim], as `KVLayout.block_shape` orders them) into one flat byte payload and
back into the reader's cache dtype, so the bytes that travel can be narrower than the cache:

- `raw`: the cache's own bytes (no conversion; the default).
- `bfloat16`: each value rounded to bf16 (half of an fp32 cache; a bf16 cache unchanged).
- `int8` / `int4`: each run of `GROUP` values along the head dimension (one token of one
  head, or a part of it: MLA's 576-wide latent entry is 9 runs) is rotated by a Hadamard
  matrix (`rotate`), scaled by its own absolute maximum and rounded to signed integers in
  -127..127 or -7..7, the fp32 scale stored beside them (4 bytes a run); int4 levels are
  packed two a byte (level + 8, even index in the low nibble). Decoding scales and rotates
  back: each rotated value comes back within half a step (scale / 2), so a run's error has
  at most sqrt(GROUP) half-steps of length.

Per token and head rather than per block: the cache is written a token at a time, and a
token's keys can be outliers its block's other tokens are not, so a run's own scale keeps
each token exact to its own range. Against a bf16 cache the payload is 0.53x (int8) or 0.28x
(int4) of the raw bytes with head dim 64; against fp32, half that.

An int8 cache (--kv-cache-dtype int8: uint8 rows of int8 values ending in their fp32 scale,
kernels/kv_format.py) moves as it is under `raw`; the other codecs encode its dequantized
values (the last dimension less the scale's bytes) and quantize them again into the reader's
rows, so an int8 cache can hand off and store 4-bit chunks.

A reader's cache may have another dtype than the writer's (an fp32 prefill worker and an int8
decode worker, a tier chunk an int8 worker wrote and a bf16 worker reads): `decode` is told
both, and rounds what it decoded into the reader's rows (`raw` included).

The payload is the levels of the whole tensor, then the fp32 scales (row-major, one per run);
`payload_bytes` says how long it must be, and `decode` refuses any other length, so a header
that lies about its codec or shape cannot make the reader read past what it received.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels.kv_format import (
    INT8_SCALE_BYTES,
    ROTATION_GROUP,
    dequantize_rows,
    quantize_rows,
    rotate_runs,
)

GROUP = ROTATION_GROUP  # values sharing one scale (and rotated together), along the head dimension
CODECS = ("raw", "bfloat16", "int8", "int4")
_LEVELS = {"int8": 127, "int4": 7}


class CodecError(ValueError):
    """A payload that does not match what its codec and shape say it must be."""


@dataclass(frozen=True)
class KVCodec:
    """How a tensor of KV blocks becomes bytes; `name` is one of CODECS."""

    name: str = "raw"

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise ValueError(f"unknown KV codec {self.name!r}: choose one of {', '.join(CODECS)}")

    @property
    def quantized(self) -> bool:
        return self.name in _LEVELS

    def payload_bytes(self, shape: tuple[int, ...], cache_dtype: torch.dtype) -> int:
        """The exact payload length for blocks of `shape` written from a `cache_dtype` cache."""
        if self.name == "raw":
            return _numel(shape) * torch.empty((), dtype=cache_dtype).element_size()
        count = _numel(_value_shape(shape, cache_dtype))
        if self.name == "bfloat16":
            return count * 2
        runs = count // group_size(_value_shape(shape, cache_dtype)[-1])
        levels = count if self.name == "int8" else count // 2
        return levels + 4 * runs

    def encode(self, blocks: torch.Tensor) -> torch.Tensor:
        """The blocks as a flat uint8 tensor (contiguous; a view of `blocks` for `raw` when it
        is contiguous already)."""
        if self.name == "raw":
            return blocks.contiguous().view(-1).view(torch.uint8)
        if blocks.dtype == torch.uint8:  # an int8 cache's rows: their values
            blocks = dequantize_rows(blocks, torch.float32)
        if self.name == "bfloat16":
            return blocks.to(torch.bfloat16).contiguous().view(-1).view(torch.uint8)
        group = group_size(blocks.shape[-1])
        runs = rotate(blocks.reshape(-1, group).float())
        top = _LEVELS[self.name]
        scales = runs.abs().amax(dim=1) / top
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        levels = torch.round(runs / safe.unsqueeze(1)).clamp_(-top, top).to(torch.int8)
        if self.name == "int4":
            nibbles = (levels + 8).to(torch.uint8).view(-1, 2)
            packed = nibbles[:, 0] | (nibbles[:, 1] << 4)
        else:
            packed = levels.view(-1).view(torch.uint8)
        return torch.cat((packed.view(-1), scales.contiguous().view(torch.uint8)))

    def decode(self, payload: torch.Tensor, shape: tuple[int, ...], cache_dtype: torch.dtype,
               writer_dtype: torch.dtype) -> torch.Tensor:
        """Blocks of `shape` in `cache_dtype` from a flat uint8 payload that a `writer_dtype`
        cache encoded; CodecError when its length is not what the codec and shape give."""
        expected = self.payload_bytes(shape, writer_dtype)
        if payload.dtype != torch.uint8 or payload.numel() != expected:
            raise CodecError(f"a {self.name} payload of {tuple(shape)} is {expected} bytes, got {payload.numel()}")
        if self.name == "raw":
            rows = payload.view(writer_dtype).view(shape)
            if writer_dtype == cache_dtype:
                return rows
            if writer_dtype == torch.uint8:  # another cache's int8 rows: their values
                rows = dequantize_rows(rows, torch.float32)
            return _to_cache(rows, cache_dtype)
        values_shape = _value_shape(shape, writer_dtype)
        if self.name == "bfloat16":
            return _to_cache(payload.view(torch.bfloat16).view(values_shape), cache_dtype)
        count = _numel(values_shape)
        group = group_size(values_shape[-1])
        split = count if self.name == "int8" else count // 2
        scales = payload[split:].view(torch.float32).view(-1, 1)
        if self.name == "int4":
            packed = payload[:split]
            levels = torch.stack(((packed & 0x0F), (packed >> 4)), dim=1).view(-1).to(torch.int8) - 8
        else:
            levels = payload[:split].view(torch.int8)
        values = rotate(levels.view(-1, group).float() * scales)
        return _to_cache(values.view(values_shape), cache_dtype)


RAW = KVCodec("raw")


def _value_shape(shape: tuple[int, ...], cache_dtype: torch.dtype) -> tuple[int, ...]:
    """The values blocks of `shape` hold: an int8 cache's rows less their scale's bytes."""
    if cache_dtype != torch.uint8:
        return tuple(shape)
    return (*shape[:-1], shape[-1] - INT8_SCALE_BYTES)


def _to_cache(values: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Decoded values in the reader's cache dtype: rounded into int8 rows for an int8 cache."""
    return quantize_rows(values) if cache_dtype == torch.uint8 else values.to(cache_dtype)


def group_size(head_dim: int) -> int:
    """Values a scale covers: GROUP where the head dimension is a multiple of it, else the whole
    head (a head dim of 80 or 96 keeps one scale a token and head)."""
    return GROUP if head_dim % GROUP == 0 else head_dim


def rotate(runs: torch.Tensor) -> torch.Tensor:
    """Each run (last dimension) rotated by the normalized Hadamard matrix of its length, its
    own inverse, where the length is a power of two (kernels/kv_format.py, which the int8 cache
    shares): an orthonormal rotation that spreads a few large channels over all of a run's
    values, so that one scale fits them. On the default model, 4-bit KV through every cached
    value cost +5.15% perplexity without it and +1.62% with it; 8 bits +0.03% / +0.02%. Other
    lengths are left as they are."""
    size = runs.shape[-1]
    return runs if size & (size - 1) else rotate_runs(runs)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count
