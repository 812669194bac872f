"""KV source and sink in one process, on plain tensors: framing, checksums, expiry, release."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.engine.block_pool import BlockPool
from tandem.kvcache.transfer import KVLayout, KVTransferError, KVTransferHandle
from tandem.kvcache.transfer.sink import KVSink, PullJob
from tandem.kvcache.transfer.source import KVSource
from tandem.kvcache.transfer.tcp import TcpTransport

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, block_size=4, head_dim=3, dtype="float32")
NUM_BLOCKS = 8


def _cache(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.block_shape(NUM_BLOCKS), generator=generator)


@pytest.fixture
def source_cache() -> torch.Tensor:
    return _cache(0)


@pytest.fixture
def source(source_cache: torch.Tensor) -> KVSource:
    src = KVSource(lambda ids: source_cache.index_select(3, torch.tensor(ids)), LAYOUT, timeout=30)
    yield src
    src.close()


def _held(source: KVSource, pool: BlockPool, block_ids: list[int]) -> KVTransferHandle:
    blocks = [pool.blocks[i] for i in block_ids]
    pool.touch(blocks)
    return source.hold("t1", blocks, [100 + i for i in range(len(blocks))])


def test_fetch_returns_the_held_blocks(source: KVSource, source_cache: torch.Tensor) -> None:
    pool = BlockPool(NUM_BLOCKS)
    handle = _held(source, pool, [5, 2, 7])
    data = TcpTransport().fetch(KVTransferHandle.from_json(handle.to_json()), [0, 2], timeout=5)
    assert torch.equal(data, source_cache.index_select(3, torch.tensor([5, 7])))


def test_unknown_transfer_and_bad_index_are_refused(source: KVSource) -> None:
    pool = BlockPool(NUM_BLOCKS)
    handle = _held(source, pool, [1])
    with pytest.raises(KVTransferError, match="out of range"):
        TcpTransport().fetch(handle, [3], timeout=5)
    other = KVTransferHandle("nope", handle.host, handle.port, [1], LAYOUT)
    with pytest.raises(KVTransferError, match="unknown or expired"):
        TcpTransport().fetch(other, [0], timeout=5)


def test_corrupted_payload_fails_the_checksum(source: KVSource, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = BlockPool(NUM_BLOCKS)
    handle = _held(source, pool, [1, 2])
    source.fault = "corrupt"
    with pytest.raises(KVTransferError, match="checksum"):
        TcpTransport().fetch(handle, [0, 1], timeout=5)


def test_unreachable_source_times_out() -> None:
    handle = KVTransferHandle("t", "127.0.0.1", 9, [1], LAYOUT)  # discard port: nobody answers
    started = time.monotonic()
    with pytest.raises(KVTransferError):
        TcpTransport().fetch(handle, [0], timeout=0.5)
    assert time.monotonic() - started < 3


def test_sink_writes_blocks_and_releases_the_source(source: KVSource, source_cache: torch.Tensor) -> None:
    pool = BlockPool(NUM_BLOCKS)
    handle = _held(source, pool, [3, 4])
    target = torch.zeros(LAYOUT.block_shape(NUM_BLOCKS))
    sink = KVSink(lambda ids, data: target.index_copy_(3, torch.tensor(ids), data), fetch_timeout=5)
    try:
        sink.submit(PullJob("r", handle, [0, 1], [6, 0]))
        deadline = time.monotonic() + 10
        results = []
        while not results and time.monotonic() < deadline:
            results = sink.results()
            time.sleep(0.01)
        assert results and results[0].ok, results
        assert torch.equal(target[:, :, :, 6], source_cache[:, :, :, 3])
        assert torch.equal(target[:, :, :, 0], source_cache[:, :, :, 4])
        # The release reached the source; the engine thread then frees the blocks.
        deadline = time.monotonic() + 5
        freed = []
        while not freed and time.monotonic() < deadline:
            freed = source.collect_released()
            time.sleep(0.01)
        assert [b.block_id for b in freed[0]] == [3, 4]
        assert source.num_held == 0
    finally:
        sink.close()


def test_held_blocks_expire(source_cache: torch.Tensor) -> None:
    source = KVSource(lambda ids: source_cache.index_select(3, torch.tensor(ids)), LAYOUT, timeout=0.2)
    try:
        pool = BlockPool(NUM_BLOCKS)
        _held(source, pool, [1, 2])
        assert source.collect_released() == []
        time.sleep(0.3)
        freed = source.collect_released()
        assert [b.block_id for b in freed[0]] == [1, 2] and source.num_held == 0
    finally:
        source.close()


def test_handle_round_trips_through_json(source: KVSource) -> None:
    pool = BlockPool(NUM_BLOCKS)
    handle = _held(source, pool, [0, 1])
    again = KVTransferHandle.from_json(handle.to_json())
    assert again == handle
    with pytest.raises(KVTransferError):
        KVTransferHandle.from_json({"transfer_id": "x"})
