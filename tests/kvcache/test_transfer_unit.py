"""KV source and sink in one process, on plain tensors: framing, checksums, leases, cancels."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch

from tandem.kvcache.transfer import KVLayout, KVTransferError, KVTransferHandle
from tandem.kvcache.transfer.shm import ShmTransport
from tandem.kvcache.transfer.sink import KVSink, PullJob
from tandem.kvcache.transfer.source import KVSource
from tandem.kvcache.transfer.tcp import TcpTransport
from tandem.worker.model_runner import shared_zeroed

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
    src = KVSource(lambda ids: source_cache.index_select(3, torch.tensor(ids)), LAYOUT)
    yield src
    src.close()


def _held(source: KVSource, block_ids: list[int], timeout: float = 30, lease_id: str = "t1") -> KVTransferHandle:
    """Lease the blocks as the prefill side's scheduler would, and build their handle."""
    hashes = [100 + i for i in range(len(block_ids))]
    source.hold(lease_id, block_ids, hashes, timeout)
    return KVTransferHandle(lease_id, source.host, source.port, hashes, LAYOUT, source.shm_path,
                            source.shm_num_blocks, timeout,
                            extra={"block_ids": list(block_ids)} if source.shm_path else {})


def _wait(poll, timeout: float = 10):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = poll()
        if value:
            return value
        time.sleep(0.01)
    return poll()


def test_fetch_returns_the_held_blocks(source: KVSource, source_cache: torch.Tensor) -> None:
    handle = _held(source, [5, 2, 7])
    data = TcpTransport().fetch(KVTransferHandle.from_json(handle.to_json()), [0, 2], timeout=5)
    assert torch.equal(data, source_cache.index_select(3, torch.tensor([5, 7])))
    assert source.blocks_sent == 2


def test_unknown_lease_and_bad_index_are_refused(source: KVSource) -> None:
    handle = _held(source, [1])
    with pytest.raises(KVTransferError, match="out of range"):
        TcpTransport().fetch(handle, [3], timeout=5)
    other = KVTransferHandle("nope", handle.host, handle.port, [1], LAYOUT)
    with pytest.raises(KVTransferError, match="unknown or expired"):
        TcpTransport().fetch(other, [0], timeout=5)


def test_corrupted_payload_fails_the_checksum(source: KVSource, monkeypatch: pytest.MonkeyPatch) -> None:
    handle = _held(source, [1, 2])
    source.fault = "corrupt"
    with pytest.raises(KVTransferError, match="checksum"):
        TcpTransport().fetch(handle, [0, 1], timeout=5)


def test_unreachable_source_times_out() -> None:
    handle = KVTransferHandle("t", "127.0.0.1", 9, [1], LAYOUT)  # discard port: nobody answers
    started = time.monotonic()
    with pytest.raises(KVTransferError):
        TcpTransport().fetch(handle, [0], timeout=0.5)
    assert time.monotonic() - started < 3


def test_sink_writes_blocks_then_the_release_ends_the_lease(source: KVSource, source_cache: torch.Tensor) -> None:
    handle = _held(source, [3, 4])
    target = torch.zeros(LAYOUT.block_shape(NUM_BLOCKS))
    sink = KVSink(lambda ids, data: target.index_copy_(3, torch.tensor(ids), data), fetch_timeout=5)
    try:
        sink.submit(PullJob("r", handle, [0, 1], [6, 0]))
        results = _wait(sink.results)
        assert results and results[0].ok, results
        assert torch.equal(target[:, :, :, 6], source_cache[:, :, :, 3])
        assert torch.equal(target[:, :, :, 0], source_cache[:, :, :, 4])
        assert source.finished() == [] and source.num_held == 1  # fetched, still leased
        sink.release_remote(handle)
        assert _wait(source.finished) == ["t1"]  # now the scheduler may free the blocks
        assert source.num_held == 0
    finally:
        sink.close()


def test_a_cancelled_load_writes_nothing_and_reports_nothing(source_cache: torch.Tensor) -> None:
    """Blocks of an aborted request may go to another at once: a late write must not land."""
    release = threading.Event()

    def slow_read(ids: list[int]) -> torch.Tensor:
        release.wait(5)
        return source_cache.index_select(3, torch.tensor(ids))

    source = KVSource(slow_read, LAYOUT)
    target = torch.zeros(LAYOUT.block_shape(NUM_BLOCKS))
    sink = KVSink(lambda ids, data: target.index_copy_(3, torch.tensor(ids), data), fetch_timeout=5)
    try:
        sink.submit(PullJob("r", _held(source, [3, 4]), [0, 1], [6, 0]))
        time.sleep(0.2)  # the fetch is in flight, blocked in the source
        sink.cancel("r")
        release.set()
        time.sleep(0.5)
        assert sink.results() == []
        assert not target.any()
    finally:
        sink.close()
        source.close()


def test_a_lease_expires_and_a_read_after_it_is_refused(source_cache: torch.Tensor) -> None:
    source = KVSource(lambda ids: source_cache.index_select(3, torch.tensor(ids)), LAYOUT)
    try:
        handle = _held(source, [1, 2], timeout=0.2)
        assert source.finished() == []
        time.sleep(0.3)
        with pytest.raises(KVTransferError, match="unknown or expired"):
            TcpTransport().fetch(handle, [0, 1], timeout=5)
        assert source.finished() == ["t1"] and source.num_held == 0
        assert source.finished() == []  # reported once
    finally:
        source.close()


def test_shared_memory_copy_is_confirmed_against_the_lease(tmp_path) -> None:  # noqa: ANN001
    """A same-host reader copies straight from the source's file; if the lease ended before
    the copy was confirmed, the blocks may have been reused, so the copy is refused."""
    path = f"/dev/shm/tandem-test-{uuid.uuid4().hex[:8]}"
    cache = shared_zeroed(path, LAYOUT.block_shape(NUM_BLOCKS), torch.float32)
    cache.copy_(_cache(1))
    source = KVSource(lambda ids: cache.index_select(3, torch.tensor(ids)), LAYOUT, shm_path=path,
                      shm_num_blocks=NUM_BLOCKS)
    try:
        shm = ShmTransport()
        handle = _held(source, [2, 5], timeout=30, lease_id="live")
        assert shm.available(handle)
        assert torch.equal(shm.fetch(handle, [0, 1], timeout=5), cache.index_select(3, torch.tensor([2, 5])))
        expiring = _held(source, [3], timeout=0.1, lease_id="old")
        time.sleep(0.2)
        cache[:, :, :, 3] = 7.0  # the block was freed and another request wrote it
        with pytest.raises(KVTransferError, match="unknown or expired"):
            shm.fetch(expiring, [0], timeout=5)
    finally:
        source.close()
        os.unlink(path)


def test_handle_round_trips_through_json(source: KVSource) -> None:
    handle = _held(source, [0, 1])
    again = KVTransferHandle.from_json(handle.to_json())
    assert again == handle
    with pytest.raises(KVTransferError):
        KVTransferHandle.from_json({"transfer_id": "x"})


def test_a_latent_cache_travels_as_one_plane_of_one_head() -> None:
    """MLA caches one latent per token (config.KVCacheSpec num_planes 1): same transport."""
    latent = KVLayout(num_layers=2, num_kv_heads=1, block_size=4, head_dim=9, dtype="float32", num_planes=1)
    assert latent.block_shape(3) == (2, 1, 1, 3, 4, 9)
    cache = torch.randn(latent.block_shape(NUM_BLOCKS), generator=torch.Generator().manual_seed(3))
    source = KVSource(lambda ids: cache.index_select(3, torch.tensor(ids)), latent)
    try:
        source.hold("lat", [4, 1], [7, 8], 30)
        handle = KVTransferHandle("lat", source.host, source.port, [7, 8], latent)
        data = TcpTransport().fetch(KVTransferHandle.from_json(handle.to_json()), [0, 1], timeout=5)
        assert torch.equal(data, cache.index_select(3, torch.tensor([4, 1])))
        wrong = KVTransferHandle("lat", source.host, source.port, [7, 8], LAYOUT)  # the K/V layout
        with pytest.raises(KVTransferError):
            TcpTransport().fetch(wrong, [0], timeout=5)
    finally:
        source.close()


def test_a_source_with_the_cluster_secret_serves_only_signed_requests(source_cache: torch.Tensor) -> None:
    """Peers without the secret, with a wrong one, or replaying a stale request are refused;
    a sink that signs with it fetches, checks and releases as usual."""
    import json as _json

    from tandem.kvcache.transfer import auth, tcp

    secret = "s3cret"
    source = KVSource(lambda ids: source_cache.index_select(3, torch.tensor(ids)), LAYOUT, secret=secret)
    try:
        handle = _held(source, [0, 1], lease_id="lease-1")
        for wrong in (None, "guess"):
            with pytest.raises(KVTransferError, match="cluster secret"):
                TcpTransport(wrong).fetch(handle, [0], timeout=5)
        stale = auth.sign(secret, [b"CHECK", _json.dumps({"transfer_id": "lease-1"}).encode()])
        assert auth.refusal(secret, stale, now=time.time() + 120) == "stale request (clock skew or a replay)"
        body = _json.loads(stale[1])
        assert auth.refusal(secret, [stale[0], _json.dumps({**body, "ts": 0}).encode(), stale[2]]) \
            == "wrong cluster secret"  # the stamp is under the MAC
        data = TcpTransport(secret).fetch(handle, [0, 1], timeout=5)
        assert torch.equal(data, source_cache.index_select(3, torch.tensor([0, 1])))
        tcp.check(handle, timeout=5, secret=secret)
        tcp.release(handle, timeout=5, secret=secret)
        assert source.refused == 2
    finally:
        source.close()
