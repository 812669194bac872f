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
- `int4` keys (where the blocks have a key plane and a value plane) go per channel instead:
  each channel of each head, over groups of `KEY_GROUP_TOKENS` consecutive tokens of the
  tensor (the last group may be shorter), keeps its own minimum (fp32) and step (fp16, a
  fifteenth of its range) and rounds to levels 0..15. Keys carry a few channels that are
  large, and often nearly constant, on every token (Qwen2.5's key bias, rotated only slowly
  by RoPE's low frequencies); a per-token scale spends 4 bits on that offset and leaves the
  channels that vary nothing: on Qwen2.5-Coder-0.5B, +53% perplexity with per-token keys,
  within 0.1% per channel (the grouping KIVI found for keys). Values stay per token.

Per token and head for values and int8 rather than per block: a token's values can be
outliers its block's other tokens are not, so a run's own scale keeps each token exact to its
own range. Against a bf16 cache the payload is 0.53x (int8) or 0.29x (int4: values 36 bytes a
token and 64-wide head, keys 32 + 6 * 64 / 64 = 38) of the raw bytes with head dim 64, over
whole groups of keys; against fp32, half that.

An int8 cache (--kv-cache-dtype int8: uint8 rows of int8 values ending in their fp32 scale,
kernels/kv_format.py) moves as it is under `raw`; the other codecs encode its dequantized
values (the last dimension less the scale's bytes) and quantize them again into the reader's
rows, so an int8 cache can hand off and store 4-bit chunks. An fp8 cache (float8 e4m3 values
over each layer's key and value scales) moves as its own bytes under `raw`, one a value, its
scales in the layout the header carries (`KVLayout.kv_scales`); `encode` and `decode` take
them, the other codecs encode the values they stand for (stored value times scale), and an
fp8 reader divides by its own scales and rounds, unless they are the writer's, when the
bytes are taken as they are.

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
    FP8,
    INT8_SCALE_BYTES,
    ROTATION_GROUP,
    dequantize_rows,
    quantize_rows,
    rotate_runs,
    to_fp8,
)

GROUP = ROTATION_GROUP  # values sharing one scale (and rotated together), along the head dimension
KEY_GROUP_TOKENS = 64  # int4 keys: tokens whose channel shares one minimum and step
_KEY_LEVELS = 15  # int4 keys: levels 0..15 from the channel's minimum
_KEY_PARAM_BYTES = 6  # a channel group's fp32 minimum and fp16 step
_FP16_MAX = 65504.0
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
        values_shape = _value_shape(shape, cache_dtype)
        count = _numel(values_shape)
        if self.name == "bfloat16":
            return count * 2
        if self.name == "int4" and _has_key_plane(values_shape):
            half = count // 2  # the keys' values; the values' as many
            return _key_bytes(values_shape) + _run_bytes(half, values_shape[-1], "int4")
        return _run_bytes(count, values_shape[-1], self.name)

    def encode(self, blocks: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks as a flat uint8 tensor (contiguous; a view of `blocks` for `raw` when it
        is contiguous already). `scales`: an fp8 cache's [layers, planes] (KVLayout.scales)."""
        if self.name == "raw":
            return blocks.contiguous().view(-1).view(torch.uint8)
        blocks = _values(blocks, scales)
        if self.name == "bfloat16":
            return blocks.to(torch.bfloat16).contiguous().view(-1).view(torch.uint8)
        if self.name == "int4" and _has_key_plane(tuple(blocks.shape)):
            return torch.cat((_encode_key_channels(blocks[:, 0].float()), _encode_runs(blocks[:, 1], "int4")))
        return _encode_runs(blocks, self.name)

    def decode(self, payload: torch.Tensor, shape: tuple[int, ...], cache_dtype: torch.dtype,
               writer_dtype: torch.dtype, cache_scales: torch.Tensor | None = None,
               writer_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks of `shape` in `cache_dtype` from a flat uint8 payload that a `writer_dtype`
        cache encoded; CodecError when its length is not what the codec and shape give. The
        scales are each side's [layers, planes] where its cache is fp8 (KVLayout.scales)."""
        expected = self.payload_bytes(shape, writer_dtype)
        if payload.dtype != torch.uint8 or payload.numel() != expected:
            raise CodecError(f"a {self.name} payload of {tuple(shape)} is {expected} bytes, got {payload.numel()}")
        if self.name == "raw":
            rows = payload.view(writer_dtype).view(shape)
            if writer_dtype == torch.uint8:
                _check_finite(rows[..., -INT8_SCALE_BYTES:].contiguous().view(torch.float32), "row scale")
            if writer_dtype == cache_dtype and (writer_dtype != FP8 or _same(cache_scales, writer_scales)):
                return rows
            return _to_cache(_values(rows, writer_scales), cache_dtype, cache_scales)
        values_shape = _value_shape(shape, writer_dtype)
        if self.name == "bfloat16":
            return _to_cache(payload.view(torch.bfloat16).view(values_shape), cache_dtype, cache_scales)
        if self.name == "int4" and _has_key_plane(values_shape):
            plane_shape = (values_shape[0], *values_shape[2:])
            split = _key_bytes(values_shape)
            keys = _decode_key_channels(payload[:split], plane_shape)
            values = _decode_runs(payload[split:], plane_shape, "int4")
            return _to_cache(torch.stack((keys, values), dim=1), cache_dtype, cache_scales)
        return _to_cache(_decode_runs(payload, values_shape, self.name), cache_dtype, cache_scales)


RAW = KVCodec("raw")


def _has_key_plane(shape: tuple[int, ...]) -> bool:
    """Blocks of keys and values ([layers, 2, ...]); MLA's latent cache has one plane, whose
    runs go per token."""
    return shape[1] == 2


def _run_bytes(count: int, head_dim: int, name: str) -> int:
    """Bytes of `count` values in rotated runs: their levels and an fp32 scale a run."""
    levels = count if name == "int8" else count // 2
    return levels + 4 * (count // group_size(head_dim))


def _key_groups(tokens: int) -> int:
    return -(-tokens // KEY_GROUP_TOKENS)


def _key_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of the keys of blocks of `shape` in int4 channel groups: two levels a byte, and a
    minimum and step per channel and group of tokens of each layer and head."""
    layers, _, heads, blocks, block_size, head_dim = shape
    tokens = blocks * block_size
    return layers * heads * tokens * head_dim // 2 + layers * heads * _key_groups(tokens) * head_dim * _KEY_PARAM_BYTES


def _pack_nibbles(levels: torch.Tensor) -> torch.Tensor:
    """Levels 0..15 two a byte, the even index in the low nibble."""
    pairs = levels.to(torch.uint8).reshape(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack(((packed & 0x0F), (packed >> 4)), dim=1).view(-1)


def _encode_runs(blocks: torch.Tensor, name: str) -> torch.Tensor:
    """Rotated runs along the head dimension, each with its own absolute-maximum scale."""
    runs = rotate(blocks.reshape(-1, group_size(blocks.shape[-1])).float())
    top = _LEVELS[name]
    scales = runs.abs().amax(dim=1) / top
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    levels = torch.round(runs / safe.unsqueeze(1)).clamp_(-top, top).to(torch.int8)
    packed = _pack_nibbles(levels + 8) if name == "int4" else levels.view(-1).view(torch.uint8)
    return torch.cat((packed.view(-1), scales.contiguous().view(torch.uint8)))


def _decode_runs(payload: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    count = _numel(shape)
    split = count if name == "int8" else count // 2
    scales = payload[split:].view(torch.float32).view(-1, 1)
    _check_finite(scales, "scale")
    if name == "int4":
        levels = _unpack_nibbles(payload[:split]).to(torch.int8) - 8
    else:
        levels = payload[:split].view(torch.int8)
    return rotate(levels.view(-1, group_size(shape[-1])).float() * scales).view(shape)


def _channel_groups(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each channel's (minimum, maximum) over each group of KEY_GROUP_TOKENS tokens of
    keys [layers, heads, tokens, head dim], as [layers, heads, groups, head dim]."""
    tokens = keys.shape[2]
    whole = tokens - tokens % KEY_GROUP_TOKENS
    lows, highs = [], []
    if whole:
        grouped = keys[:, :, :whole].unflatten(2, (whole // KEY_GROUP_TOKENS, KEY_GROUP_TOKENS))
        lows.append(grouped.amin(dim=3))
        highs.append(grouped.amax(dim=3))
    if whole < tokens:
        lows.append(keys[:, :, whole:].amin(dim=2, keepdim=True))
        highs.append(keys[:, :, whole:].amax(dim=2, keepdim=True))
    return torch.cat(lows, dim=2), torch.cat(highs, dim=2)


def _per_token(params: torch.Tensor, tokens: int) -> torch.Tensor:
    return params.repeat_interleave(KEY_GROUP_TOKENS, dim=2)[:, :, :tokens]


def _encode_key_channels(keys: torch.Tensor) -> torch.Tensor:
    """Keys [layers, heads, blocks, block size, head dim] as levels 0..15 from each channel
    group's minimum in steps of a fifteenth of its range; then the minima (fp32) and steps
    (fp16, which rounding and the levels' clamp absorb)."""
    keys = keys.flatten(2, 3)
    tokens = keys.shape[2]
    lows, highs = _channel_groups(keys)
    steps = ((highs - lows) / _KEY_LEVELS).clamp_(max=_FP16_MAX).to(torch.float16)
    safe = torch.where(steps > 0, steps.float(), torch.ones_like(lows))
    levels = torch.round((keys - _per_token(lows, tokens)) / _per_token(safe, tokens)).clamp_(0, _KEY_LEVELS)
    return torch.cat((_pack_nibbles(levels), lows.contiguous().view(-1).view(torch.uint8),
                      steps.contiguous().view(-1).view(torch.uint8)))


def _decode_key_channels(payload: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Keys of `shape` ([layers, heads, blocks, block size, head dim]) from their levels,
    minima and steps."""
    layers, heads, blocks, block_size, head_dim = shape
    tokens = blocks * block_size
    params = layers * heads * _key_groups(tokens) * head_dim
    split = layers * heads * tokens * head_dim // 2
    levels = _unpack_nibbles(payload[:split]).view(layers, heads, tokens, head_dim).float()
    lows = payload[split : split + 4 * params].view(torch.float32).view(layers, heads, -1, head_dim)
    steps = payload[split + 4 * params :].view(torch.float16).view(layers, heads, -1, head_dim).float()
    _check_finite(lows, "key minimum")
    _check_finite(steps, "key step")
    keys = _per_token(lows, tokens) + levels * _per_token(steps, tokens)
    return keys.view(shape)


def _check_finite(params: torch.Tensor, what: str) -> None:
    """A quantized payload's scales, minima or steps must be finite: a NaN or infinite one
    (a corrupt or forged chunk; the encoders never write one) would decode into NaN keys or
    values that poison every attention read of the sequence, so the payload is refused and
    the prefix recomputed. Float payloads' values are data, passed as they are."""
    if not bool(torch.isfinite(params).all()):
        raise CodecError(f"a payload holds a non-finite {what}")


def _value_shape(shape: tuple[int, ...], cache_dtype: torch.dtype) -> tuple[int, ...]:
    """The values blocks of `shape` hold: an int8 cache's rows less their scale's bytes."""
    if cache_dtype != torch.uint8:
        return tuple(shape)
    return (*shape[:-1], shape[-1] - INT8_SCALE_BYTES)


def _values(rows: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """What a cache's rows stand for: an int8 cache's dequantized values, an fp8 cache's stored
    values times their layer's and plane's scale (exact in fp32), a float cache's rows."""
    if rows.dtype == torch.uint8:
        return dequantize_rows(rows, torch.float32)
    if rows.dtype == FP8:
        return rows.float() * _per_plane(scales, rows)
    return rows


def _to_cache(values: torch.Tensor, cache_dtype: torch.dtype, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Decoded values in the reader's cache dtype: rounded into int8 rows for an int8 cache,
    divided by the layer's scales and rounded to e4m3 for an fp8 one."""
    if cache_dtype == torch.uint8:
        return quantize_rows(values)
    if cache_dtype == FP8:
        return to_fp8(values.float() / _per_plane(scales, values))
    return values.to(cache_dtype)


def _per_plane(scales: torch.Tensor | None, blocks: torch.Tensor) -> torch.Tensor:
    """[layers, planes] scales shaped to multiply blocks [layers, planes, heads, blocks, block
    size, head dim]; a ValueError where an fp8 side gave none."""
    if scales is None or tuple(scales.shape) != tuple(blocks.shape[:2]):
        raise ValueError(f"fp8 blocks of {tuple(blocks.shape)} need [layers, planes] scales, got "
                         f"{None if scales is None else tuple(scales.shape)}")
    return scales.to(torch.float32).view(*scales.shape, 1, 1, 1, 1)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and torch.equal(a, b)


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
