"""An fp8 cache's blocks on the wire and in the tiers: its own bytes, its scales in the layout.

An fp8 cache stores each key and value over its layer's scale (worker/kv_scales.py); the
bytes mean nothing without the scales, so the layout a handoff reply or a tier chunk names
carries them (`KVLayout.kv_scales`), and the codec (kvcache/codec.py) converts: an fp8 reader
with the writer's scales takes the bytes as they are, one with other scales divides and
rounds again, a reader of another dtype multiplies them out; the 8- and 4-bit codecs encode
the values the bytes stand for. Under `raw` a row of 64 is 64 bytes, half a bf16 row's.
"""

from __future__ import annotations

import dataclasses
import math
import os
import uuid

import pytest
import torch

from tandem.kernels.kv_format import quantize_rows, to_fp8
from tandem.kvcache.codec import KVCodec
from tandem.kvcache.transfer import KVLayout, KVTransferHandle
from tandem.kvcache.transfer.base import writer_layout
from tandem.kvcache.transfer.shm import ShmTransport
from tandem.kvcache.transfer.source import KVSource
from tandem.kvcache.transfer.tcp import TcpTransport
from tandem.kvcache.transfer.wire import FrameKey
from tandem.platform.lazy_memory import shared_zeroed

FP8 = torch.float8_e4m3fn
SECRET = "test-cluster-secret"
KEY = FrameKey(SECRET)
NUM_BLOCKS = 6
SCALES = (0.5, 2.0, 1.0, 0.25)  # (key, value) of each of 2 layers
OTHER = (1.0, 1.0, 0.5, 4.0)


def _layout(dtype: str = "float8_e4m3fn", scales: tuple[float, ...] = SCALES) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, block_size=4, head_dim=64, dtype=dtype, kv_scales=scales)


def _values(seed: int = 0) -> torch.Tensor:
    """Values an fp8 cache of SCALES holds exactly, with a few over e4m3's range unscaled."""
    blocks = torch.randn(_layout().block_shape(NUM_BLOCKS), generator=torch.Generator().manual_seed(seed)) * 50
    return _stored(blocks, SCALES).float() * _scales(SCALES)


def _scales(scales: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(scales).view(2, 2, 1, 1, 1, 1)


def _stored(values: torch.Tensor, scales: tuple[float, ...]) -> torch.Tensor:
    return to_fp8(values / _scales(scales))


def test_raw_moves_the_bytes_and_a_reader_of_the_same_scales_keeps_them() -> None:
    stored = _stored(_values(), SCALES)
    shape = tuple(stored.shape)
    codec = KVCodec("raw")
    payload = codec.encode(stored, _layout().scales())
    assert payload.numel() == codec.payload_bytes(shape, FP8) == stored.numel()  # a byte a value
    assert payload.numel() * 2 == codec.payload_bytes(shape, torch.bfloat16)
    back = codec.decode(payload, shape, FP8, FP8, _layout().scales(), _layout().scales())
    assert back.dtype == FP8 and torch.equal(back.view(torch.uint8), stored.view(torch.uint8))


def test_readers_of_other_dtypes_and_scales_get_the_values() -> None:
    values = _values(1)
    stored = _stored(values, SCALES)
    shape, writer = tuple(stored.shape), _layout().scales()
    codec = KVCodec("raw")
    payload = codec.encode(stored, writer)
    assert torch.equal(codec.decode(payload, shape, torch.float32, FP8, None, writer), values)  # exact
    assert torch.equal(codec.decode(payload, shape, torch.bfloat16, FP8, None, writer), values.bfloat16())
    other = codec.decode(payload, shape, FP8, FP8, _layout(scales=OTHER).scales(), writer)
    assert torch.equal(other.view(torch.uint8), _stored(values, OTHER).view(torch.uint8))
    assert torch.equal(codec.decode(payload, shape, torch.uint8, FP8, None, writer), quantize_rows(values))
    # and a float writer's rows into an fp8 reader: divided by the reader's scales and rounded
    into = codec.decode(codec.encode(values), shape, FP8, torch.float32, writer, None)
    assert torch.equal(into.view(torch.uint8), stored.view(torch.uint8))


@pytest.mark.parametrize("name", ["bfloat16", "int8", "int4"])
def test_the_narrow_codecs_encode_the_values_the_bytes_stand_for(name: str) -> None:
    values = _values(2)
    stored = _stored(values, SCALES)
    shape, scales = tuple(stored.shape), _layout().scales()
    codec = KVCodec(name)
    payload = codec.encode(stored, scales)
    assert torch.equal(payload, codec.encode(values))
    assert payload.numel() == codec.payload_bytes(shape, FP8)
    back = codec.decode(payload, shape, FP8, FP8, scales, scales)
    want = codec.decode(codec.encode(values), shape, torch.float32, torch.float32)
    assert torch.equal(back.view(torch.uint8), _stored(want, SCALES).view(torch.uint8))


def test_fp8_blocks_without_their_scales_are_refused() -> None:
    stored = _stored(_values(), SCALES)
    with pytest.raises(ValueError, match="scales"):
        KVCodec("int8").encode(stored)
    payload = KVCodec("raw").encode(stored)
    with pytest.raises(ValueError, match="scales"):
        KVCodec("raw").decode(payload, tuple(stored.shape), torch.float32, FP8, None, None)


@pytest.mark.parametrize("scales", [
    [0.5, 2.0, 1.0], [0.5, 2.0, 1.0, 0.25, 1.0], [0.5, float("nan"), 1.0, 0.25], [0.5, math.inf, 1.0, 0.25],
    [0.5, 0.0, 1.0, 0.25], [0.5, -2.0, 1.0, 0.25], [0.5, True, 1.0, 0.25], [0.5, "2", 1.0, 0.25], "0.5,2",
    [0.5, 2.0**80, 1.0, 0.25],
])
def test_a_layout_with_scales_it_cannot_have_is_not_a_writer(scales) -> None:  # noqa: ANN001
    """The scales come in a header (a peer's reply, a stored chunk): one finite, positive,
    not absurd number per layer and plane, or the blocks are not read."""
    sent = {**dataclasses.asdict(_layout()), "kv_scales": scales}
    assert writer_layout(dataclasses.asdict(_layout()), sent) is None


def test_only_an_fp8_layout_carries_scales() -> None:
    reader = dataclasses.asdict(_layout("float32", ()))
    assert writer_layout(reader, {**reader, "kv_scales": [1.0] * 4}) is None
    assert writer_layout(reader, {**reader, "dtype": "float8_e4m3fn", "kv_scales": []}) is None
    sent = writer_layout(reader, {**reader, "dtype": "float8_e4m3fn", "kv_scales": list(OTHER)})
    assert sent == _layout(scales=OTHER) and sent.kv_scales == OTHER  # a tuple again, from JSON's list


def _fp8_source(shm_path: str | None = None) -> tuple[KVSource, torch.Tensor]:
    layout = _layout()
    if shm_path:
        cache = shared_zeroed(shm_path, layout.block_shape(NUM_BLOCKS), FP8)
        cache.view(torch.uint8).copy_(_stored(_values(3), SCALES).view(torch.uint8))
    else:
        cache = _stored(_values(3), SCALES)
    read = lambda ids: cache.view(torch.uint8).index_select(3, torch.tensor(ids)).view(FP8)  # noqa: E731
    return KVSource(read, layout, SECRET, shm_path=shm_path, shm_num_blocks=NUM_BLOCKS if shm_path else 0), cache


def test_an_fp8_source_serves_fp8_and_float_readers_over_the_port() -> None:
    source, cache = _fp8_source()
    try:
        source.hold("f", [4, 1], [7, 8], 30)
        handle = KVTransferHandle("f", source.host, source.port, [7, 8])
        picked = cache.view(torch.uint8).index_select(3, torch.tensor([4, 1])).view(FP8)
        same = TcpTransport(KEY, _layout()).fetch(handle, [0, 1], timeout=5)
        assert same.dtype == FP8 and torch.equal(same.view(torch.uint8), picked.view(torch.uint8))
        assert source.bytes_sent == picked.numel()  # a byte a value
        other = TcpTransport(KEY, _layout(scales=OTHER)).fetch(handle, [0, 1], timeout=5)
        values = picked.float() * _scales(SCALES)
        assert torch.equal(other.view(torch.uint8), _stored(values, OTHER).view(torch.uint8))
        wide = TcpTransport(KEY, _layout("float32", ())).fetch(handle, [0, 1], timeout=5)
        assert torch.equal(wide, values)
        narrow = TcpTransport(KEY, _layout("float32", ()), KVCodec("int8")).fetch(handle, [0, 1], timeout=5)
        int8 = KVCodec("int8")
        assert torch.equal(narrow, int8.decode(int8.encode(values), tuple(values.shape), torch.float32, torch.float32))
    finally:
        source.close()


def test_shared_memory_between_fp8_caches_of_the_same_scales_only() -> None:
    """The source's file holds its bytes: a reader with the same scales copies them; one with
    other scales asks over the port, which sends the bytes and scales it converts."""
    path = f"/dev/shm/tandem-test-{uuid.uuid4().hex[:8]}"
    source, cache = _fp8_source(path)
    try:
        source.hold("s", [2, 5], [1, 2], 30)
        handle = KVTransferHandle("s", source.host, source.port, [1, 2])
        picked = cache.view(torch.uint8).index_select(3, torch.tensor([2, 5]))
        shm = ShmTransport(KEY, _layout())
        got = shm.fetch(handle, [0, 1], timeout=5)
        assert shm.last_transport == "shm" and torch.equal(got.view(torch.uint8), picked)
        assert source.bytes_sent == 0
        other = ShmTransport(KEY, _layout(scales=OTHER))
        converted = other.fetch(handle, [0, 1], timeout=5)
        assert other.last_transport == "tcp" and source.bytes_sent == picked.numel()
        values = picked.view(FP8).float() * _scales(SCALES)
        assert torch.equal(converted.view(torch.uint8), _stored(values, OTHER).view(torch.uint8))
    finally:
        source.close()
        os.unlink(path)
