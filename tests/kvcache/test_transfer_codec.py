"""Prompt KV over the KV port in 8 or 4 bits (--kv-transfer-dtype): what the decode worker
asks for is what travels, decoded into its cache's dtype; the bytes are counted."""

from __future__ import annotations

import time
from dataclasses import asdict

import pytest
import torch

from tandem.kvcache.codec import KVCodec, rotate
from tandem.kvcache.transfer import KVLayout, KVTransferError, KVTransferHandle, tcp
from tandem.kvcache.transfer.sink import KVSink, PullJob
from tandem.kvcache.transfer.source import KVSource
from tandem.kvcache.transfer.tcp import TcpTransport
from tandem.kvcache.transfer.wire import FETCH, FrameKey

SECRET = "test-cluster-secret"
KEY = FrameKey(SECRET)
NUM_BLOCKS = 6


def _source(layout: KVLayout) -> tuple[KVSource, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    cache = torch.randn(layout.block_shape(NUM_BLOCKS), generator=generator).to(layout.torch_dtype)
    source = KVSource(lambda ids: cache.index_select(3, torch.tensor(ids, dtype=torch.long)), layout, SECRET)
    return source, cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["bfloat16", "int8", "int4"])
def test_the_blocks_travel_in_the_codec_the_reader_asks_for(dtype: str, name: str) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, block_size=4, head_dim=64, dtype=dtype)
    source, cache = _source(layout)
    try:
        source.hold("c", [5, 2, 0], [11, 12, 13], 30)
        handle = KVTransferHandle("c", source.host, source.port, [11, 12, 13])
        codec = KVCodec(name)
        transport = TcpTransport(KEY, layout, codec)
        got = transport.fetch(handle, [0, 2], timeout=5)
        blocks = cache.index_select(3, torch.tensor([5, 0]))
        assert got.dtype == layout.torch_dtype and got.shape == blocks.shape
        assert torch.equal(got, codec.decode(codec.encode(blocks), tuple(blocks.shape), layout.torch_dtype,
                                             layout.torch_dtype))
        sent = codec.payload_bytes(tuple(blocks.shape), layout.torch_dtype)
        assert source.bytes_sent == transport.bytes_received == sent
        raw = KVCodec("raw").payload_bytes(tuple(blocks.shape), layout.torch_dtype)
        assert sent < raw or (name == "bfloat16" and dtype == "bfloat16")
    finally:
        source.close()


def test_the_sink_counts_the_bytes_it_moved() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=2, block_size=4, head_dim=64, dtype="float32")
    source, cache = _source(layout)
    target = torch.zeros(layout.block_shape(NUM_BLOCKS))
    sink = KVSink(lambda ids, data: target.index_copy_(3, torch.tensor(ids), data), layout, SECRET,
                  fetch_timeout=5, use_shm=False, codec="int4")
    try:
        source.hold("s", [1, 3], [1, 2], 30)
        sink.submit(PullJob("r", KVTransferHandle("s", source.host, source.port, [1, 2]), [0, 1], [4, 5]))
        deadline = time.monotonic() + 10
        results = []
        while not results and time.monotonic() < deadline:
            results = sink.results()
            time.sleep(0.01)
        assert results and results[0].ok, results
        assert results[0].nbytes == KVCodec("int4").payload_bytes(layout.block_shape(2), torch.float32)
        sent = cache[:, :, :, [1, 3]]
        step = rotate(sent).abs().amax(dim=-1) / 7  # each run's error: at most 8 half-steps long
        assert bool(((target[:, :, :, [4, 5]] - sent).norm(dim=-1) <= step / 2 * 8 * (1 + 1e-4) + 1e-6).all())
    finally:
        sink.close()
        source.close()


def test_a_source_refuses_a_codec_it_does_not_know() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, block_size=4, head_dim=64, dtype="float32")
    source, _ = _source(layout)
    try:
        source.hold("u", [0], [9], 30)
        handle = KVTransferHandle("u", source.host, source.port, [9])
        for codec in ("int2", 4, None, ["int8"]):
            with pytest.raises(KVTransferError, match="codec must be one of"):
                tcp.request(handle, KEY, FETCH, {"transfer_id": "u", "indices": [0], "codec": codec}, 5)
    finally:
        source.close()


def test_a_reply_in_another_codec_than_asked_is_not_read() -> None:
    """The reader sizes its buffer for the codec it asked for; a reply naming another (a source
    of an older build answering raw bytes) is refused before its body is read."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, block_size=4, head_dim=64, dtype="float32")
    receiver = tcp.BlockReceiver(layout, 1, KVCodec("int8"))
    shape, sent = list(layout.block_shape(1)), asdict(layout)
    raw = KVCodec("raw").payload_bytes(layout.block_shape(1), torch.float32)
    int8 = KVCodec("int8").payload_bytes(layout.block_shape(1), torch.float32)
    with pytest.raises(tcp.FrameError):
        receiver(0x80, {"shape": shape, "layout": sent}, raw)  # no codec named: raw
    with pytest.raises(tcp.FrameError):
        receiver(0x80, {"shape": shape, "layout": sent, "codec": "int4"}, int8)
    with pytest.raises(tcp.FrameError):  # no layout: the reader cannot know the rows' dtype
        receiver(0x80, {"shape": shape, "codec": "int8"}, int8)
    assert receiver(0x80, {"shape": shape, "layout": sent, "codec": "int8"}, int8) is not None
    assert receiver.nbytes == int8


def test_a_reply_from_a_cache_of_another_dtype_is_sized_by_its_layout() -> None:
    """An int8 cache's rows (uint8, the scale's 4 bytes after 64 values) sent raw to an fp32
    reader: the body is read at the writer's size and shape; another geometry, or a dtype
    that is not a cache's, is refused before the body is read."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, block_size=4, head_dim=64, dtype="float32")
    writer = KVLayout(num_layers=1, num_kv_heads=1, block_size=4, head_dim=64, dtype="uint8")
    receiver = tcp.BlockReceiver(layout, 2, KVCodec("raw"))
    assert receiver(0x80, {"shape": list(writer.block_shape(2)), "layout": asdict(writer)}, 2 * 2 * 4 * 68)
    assert receiver.shape == (1, 2, 1, 2, 4, 68) and receiver.nbytes == 2 * 2 * 4 * 68
    for bad in ({**asdict(writer), "head_dim": 32}, {**asdict(writer), "dtype": "int64"},
                {**asdict(writer), "extra": 1}):
        with pytest.raises(tcp.FrameError):
            tcp.BlockReceiver(layout, 2)(0x80, {"shape": list(writer.block_shape(2)), "layout": bad}, 2 * 2 * 4 * 68)
