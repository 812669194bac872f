"""KV codecs for the wire and the tiers: exact as they are, within half a step quantized."""

from __future__ import annotations

import pytest
import torch

from tandem.kvcache.codec import (
    CODECS,
    GROUP,
    KEY_GROUP_TOKENS,
    RAW,
    CodecError,
    KVCodec,
    group_size,
    rotate,
)

# [layers, planes, kv heads, blocks, block size, head dim]
SHAPES = {"gqa": (2, 2, 3, 4, 16, 64), "wide heads": (1, 2, 2, 3, 16, 128), "mla latent": (2, 1, 1, 3, 16, 576),
          "head dim 80": (1, 2, 2, 2, 16, 80), "a group and a tail": (1, 2, 2, 5, 16, 64)}


def _blocks(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * torch.rand(shape[:-1] + (1,), generator=generator) * 4).to(dtype)


def _roundtrip(codec: KVCodec, blocks: torch.Tensor, reader: torch.dtype) -> torch.Tensor:
    payload = codec.encode(blocks)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == codec.payload_bytes(tuple(blocks.shape), blocks.dtype)
    # what a reader gets is bytes: a fresh buffer, not the writer's tensor
    received = torch.frombuffer(bytearray(payload.numpy().tobytes()), dtype=torch.uint8)
    return codec.decode(received, tuple(blocks.shape), reader, blocks.dtype)


@pytest.mark.parametrize("writer", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reader", [torch.float32, torch.bfloat16])
def test_raw_and_bfloat16_are_the_casts(writer: torch.dtype, reader: torch.dtype) -> None:
    blocks = _blocks(SHAPES["gqa"], writer)
    assert torch.equal(_roundtrip(KVCodec("raw"), blocks, reader), blocks.to(reader))
    assert torch.equal(_roundtrip(KVCodec("bfloat16"), blocks, reader), blocks.to(torch.bfloat16).to(reader))


@pytest.mark.parametrize("name, levels", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_quantized_values_come_back_within_half_a_step(name: str, levels: int, shape: tuple[int, ...]) -> None:
    """Within half a step in the rotated run (exact in the plain one where the run's length is
    no power of two), so a run's error is at most sqrt(length) half-steps long; for int4, of
    the values (its keys go per channel: the next test)."""
    blocks = _blocks(shape, torch.float32, seed=len(name))
    got = _roundtrip(KVCodec(name), blocks, torch.float32)
    if name == "int4" and shape[1] == 2:
        blocks, got = blocks[:, 1], got[:, 1]
    group = group_size(shape[-1])
    runs, back = rotate(blocks.reshape(-1, group)), rotate(got.reshape(-1, group))
    step = runs.abs().amax(dim=1, keepdim=True) / levels
    error = (back - runs).abs()
    assert bool((error <= step / 2 * (1 + 1e-4) + 1e-6).all())
    assert error.max() > 0  # it is quantized, not passed through
    plain = (got.reshape(-1, group) - blocks.reshape(-1, group)).norm(dim=1)
    assert bool((plain <= step.squeeze(1) / 2 * group**0.5 * (1 + 1e-4) + 1e-6).all())


def _channel_steps(keys: torch.Tensor) -> torch.Tensor:
    """Each key's step: a fifteenth of its channel's range over its group of tokens, from
    keys [layers, heads, blocks, block size, head dim]."""
    flat = keys.flatten(2, 3)
    steps = torch.cat([(part.amax(dim=2, keepdim=True) - part.amin(dim=2, keepdim=True)).expand_as(part) / 15
                       for part in flat.split(KEY_GROUP_TOKENS, dim=2)], dim=2)
    return steps.view(keys.shape)


@pytest.mark.parametrize("shape", [s for s in SHAPES.values() if s[1] == 2], ids=[k for k, s in SHAPES.items() if s[1] == 2])
def test_int4_keys_come_back_within_half_a_step_of_their_channel_group(shape: tuple[int, ...]) -> None:
    """Each key channel of each head, over each KEY_GROUP_TOKENS tokens (the last group
    shorter), has its own minimum and a fifteenth of its range as its step; every key comes
    back within half of it (the step is stored in fp16: a little more)."""
    blocks = _blocks(shape, torch.float32, seed=3)
    keys, got = blocks[:, 0], _roundtrip(KVCodec("int4"), blocks, torch.float32)[:, 0]
    error = (got - keys).abs()
    assert bool((error <= _channel_steps(keys) * (0.5 + 1e-2) + 1e-6).all())
    assert error.max() > 0


def test_a_key_channels_constant_offset_costs_int4_nothing() -> None:
    """Qwen2.5's keys: a few channels hold a large, nearly constant offset on every token (its
    key bias). Per channel, the offset is the group's minimum and the levels spend all their
    steps on what varies; one scale a token would spend them on the offset."""
    blocks = _blocks(SHAPES["gqa"], torch.float32)
    blocks[:, 0, :, :, :, 5] += 300.0
    got = _roundtrip(KVCodec("int4"), blocks, torch.float32)
    error = (got[:, 0] - blocks[:, 0]).abs()
    assert error.amax() <= _channel_steps(blocks[:, 0]).amax() * 0.51 + 1e-3  # the offset adds no error
    assert error.amax() < 2.0  # std-normal values times up to 4; a step of 300 / 7 per token otherwise


def test_the_rotation_is_its_own_inverse_and_keeps_lengths() -> None:
    runs = torch.randn(10, 64, generator=torch.Generator().manual_seed(5))
    assert torch.allclose(rotate(rotate(runs)), runs, atol=1e-5)
    assert torch.allclose(rotate(runs).norm(dim=1), runs.norm(dim=1), rtol=1e-5)
    assert not torch.allclose(rotate(runs), runs)
    odd = torch.randn(3, 80)
    assert torch.equal(rotate(odd), odd)  # no Hadamard matrix of 80: left as it is


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_each_tokens_values_have_their_own_scale(name: str) -> None:
    """An outlier token (1,000x) coarsens only its own run, not its block's other tokens."""
    blocks = _blocks(SHAPES["gqa"], torch.float32)
    calm = _roundtrip(KVCodec(name), blocks, torch.float32)
    blocks_outlier = blocks.clone()
    blocks_outlier[0, 1, 0, 0, 3] *= 1000
    loud = _roundtrip(KVCodec(name), blocks_outlier, torch.float32)
    others = torch.ones(blocks.shape[:-1], dtype=torch.bool)
    others[0, 1, 0, 0, 3] = False
    assert torch.equal(loud[others], calm[others])


def test_an_int4_key_outlier_coarsens_only_its_channel_group() -> None:
    """A key outlier (1,000x in one channel) widens that channel's step over its own group of
    tokens only: other channels, heads, layers and groups come back as they did."""
    shape = (2, 2, 3, 8, 16, 64)  # 128 tokens: two groups
    blocks = _blocks(shape, torch.float32)
    calm = _roundtrip(KVCodec("int4"), blocks, torch.float32)
    blocks[1, 0, 2, 1, 3, 7] *= 1000  # layer 1, head 2, token 19 (group 0), channel 7
    loud = _roundtrip(KVCodec("int4"), blocks, torch.float32)
    changed = (loud != calm).nonzero().tolist()
    assert changed and all(c[:3] == [1, 0, 2] and c[3] < 4 and c[5] == 7 for c in changed)


def test_the_bytes_against_a_bf16_cache_meet_the_goals() -> None:
    """Head dim 64 (the default model, Qwen2.5-Coder): int8 <= 0.55x, int4 <= 0.3x of bf16's."""
    shape = SHAPES["gqa"]
    bf16 = KVCodec("raw").payload_bytes(shape, torch.bfloat16)
    assert KVCodec("int8").payload_bytes(shape, torch.bfloat16) / bf16 == pytest.approx((64 + 4) / 128)
    # int4: values 32 bytes of levels and a 4-byte scale a token and head; keys 32 bytes of
    # levels and a 6-byte minimum and step a channel per 64 tokens (this shape's 64 tokens)
    assert KVCodec("int4").payload_bytes(shape, torch.bfloat16) / bf16 == pytest.approx((32 + 4 + 32 + 6) / 256)
    assert KVCodec("int4").payload_bytes(shape, torch.bfloat16) / bf16 <= 0.3
    assert KVCodec("int4").payload_bytes(shape, torch.float32) == KVCodec("int4").payload_bytes(shape, torch.bfloat16)


def test_zero_runs_stay_zero() -> None:
    blocks = torch.zeros(SHAPES["gqa"])
    for name in CODECS:
        assert torch.equal(_roundtrip(KVCodec(name), blocks, torch.float32), blocks)


@pytest.mark.parametrize("name", CODECS)
def test_a_payload_of_another_length_is_refused(name: str) -> None:
    codec, shape = KVCodec(name), SHAPES["gqa"]
    payload = codec.encode(_blocks(shape, torch.float32))
    for wrong in (payload[:-1], torch.cat((payload, payload[:1])), payload[:0]):
        with pytest.raises(CodecError):
            codec.decode(wrong, shape, torch.float32, torch.float32)
    with pytest.raises(CodecError):  # the right length of the wrong element type
        codec.decode(payload.view(torch.int8), shape, torch.float32, torch.float32)


def test_an_unknown_codec_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="int2"):
        KVCodec("int2")


def test_the_group_is_the_head_when_it_does_not_divide() -> None:
    assert group_size(64) == group_size(576) == GROUP and group_size(80) == 80


@pytest.mark.parametrize("name", ["raw", "bfloat16", "int8", "int4"])
def test_an_int8_caches_rows_travel_in_every_codec(name: str) -> None:
    """--kv-cache-dtype int8: uint8 rows of 64 values and a 4-byte scale. `raw` moves the rows
    as they are; the other codecs encode their values (no scale bytes among them) and round
    them into rows again for the reader, within the reader's own rounding of the codec's."""
    from tandem.kernels.kv_format import dequantize_rows, quantize_rows

    values = torch.randn(2, 2, 3, 4, 16, 64, generator=torch.Generator().manual_seed(9))
    rows = quantize_rows(values)  # what the cache holds
    codec = KVCodec(name)
    payload = codec.encode(rows)
    assert payload.numel() == codec.payload_bytes(tuple(rows.shape), torch.uint8)
    if name != "raw":
        assert payload.numel() == codec.payload_bytes(tuple(values.shape), torch.float32)  # the values' payload
    back = codec.decode(payload, tuple(rows.shape), torch.uint8, torch.uint8)
    assert back.dtype == torch.uint8 and back.shape == rows.shape
    if name == "raw":
        assert torch.equal(back, rows)
        return
    exact = dequantize_rows(rows, torch.float32)
    error = (dequantize_rows(back, torch.float32) - exact).abs().amax()
    bound = {"bfloat16": 0.05, "int8": 0.06, "int4": 0.9}[name]  # std-normal values, |x| < ~5
    assert 0 < error < bound


@pytest.mark.parametrize("name", ["raw", "bfloat16", "int8", "int4"])
def test_rows_cross_between_an_int8_cache_and_a_float_one(name: str) -> None:
    """A reader whose cache dtype is not the writer's (an fp32 prefill worker and an int8
    decode worker, or the other way): every codec, `raw` included, rounds what it decoded into
    the reader's rows; an int8 reader's rows equal what its own writer makes of the values."""
    from tandem.kernels.kv_format import dequantize_rows, quantize_rows

    values = torch.randn(2, 2, 3, 4, 16, 64, generator=torch.Generator().manual_seed(11))
    codec = KVCodec(name)
    into_int8 = codec.decode(codec.encode(values), tuple(values.shape), torch.uint8, torch.float32)
    assert into_int8.dtype == torch.uint8 and into_int8.shape == (2, 2, 3, 4, 16, 68)
    if name in ("raw", "bfloat16"):  # the values as they were (bf16: rounded first)
        sent = values if name == "raw" else values.to(torch.bfloat16).float()
        assert torch.equal(into_int8, quantize_rows(sent))
    rows = quantize_rows(values)
    into_fp32 = codec.decode(codec.encode(rows), tuple(rows.shape), torch.float32, torch.uint8)
    assert into_fp32.dtype == torch.float32 and into_fp32.shape == values.shape
    exact = dequantize_rows(rows, torch.float32)
    if name == "raw":
        assert torch.equal(into_fp32, exact)
    else:
        assert (into_fp32 - exact).abs().amax() < {"bfloat16": 0.05, "int8": 0.06, "int4": 0.9}[name]


def _poisoned(payload: torch.Tensor, offset: int, value: float, dtype: torch.dtype) -> torch.Tensor:
    """A copy of `payload` with the `dtype` number at byte `offset` set to `value`."""
    poisoned = payload.clone()
    width = torch.empty((), dtype=dtype).element_size()
    poisoned[offset : offset + width] = torch.tensor([value], dtype=dtype).view(torch.uint8)
    return poisoned


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_scale_minimum_or_step_is_refused(bad: float) -> None:
    """A forged or corrupt chunk whose scale, key minimum or key step is NaN or infinite would
    decode into NaN KV that poisons every later read of the sequence: it is refused, as a
    payload of the wrong length is, and the reader recomputes the prefix."""
    from tandem.kernels.kv_format import quantize_rows

    shape = SHAPES["gqa"]
    layers, _, heads, blocks, block_size, dim = shape
    blocks_ = _blocks(shape, torch.float32)
    key_levels = layers * heads * blocks * block_size * dim // 2
    key_params = layers * heads * 1 * dim  # one group of 64 tokens per layer and head
    cases = [
        ("int8", -4, torch.float32),  # the last run's scale
        ("int4", -4, torch.float32),  # the last value run's scale
        ("int4", key_levels, torch.float32),  # the first key channel's minimum
        ("int4", key_levels + 4 * key_params, torch.float16),  # its step
    ]
    for name, offset, dtype in cases:
        codec = KVCodec(name)
        payload = codec.encode(blocks_)
        codec.decode(payload, shape, torch.float32, torch.float32)  # as written: accepted
        with pytest.raises(CodecError, match="non-finite"):
            codec.decode(_poisoned(payload, offset % payload.numel(), bad, dtype), shape, torch.float32, torch.float32)
    rows = quantize_rows(blocks_)  # an int8 cache's rows under `raw`: each row's scale
    payload = RAW.encode(rows)
    for reader in (torch.uint8, torch.float32):
        with pytest.raises(CodecError, match="non-finite row scale"):
            RAW.decode(_poisoned(payload, payload.numel() - 4, bad, torch.float32), tuple(rows.shape), reader, torch.uint8)
