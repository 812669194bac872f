"""KV source and sink in one process, on plain tensors: framing, signatures, leases, cancels."""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
import threading
import time
import uuid

import psutil
import pytest
import torch

from tandem.bench.hostile import Listener
from tandem.kvcache.codec import KVCodec
from tandem.kvcache.transfer import KVLayout, KVTransferError, KVTransferHandle, tcp
from tandem.kvcache.transfer.shm import ShmTransport
from tandem.kvcache.transfer.sink import KVSink, PullJob
from tandem.kvcache.transfer.source import KVSource
from tandem.kvcache.transfer.tcp import TcpTransport
from tandem.kvcache.transfer.wire import CHECK, MAGIC, FrameKey, recv_frame, send_frame
from tandem.platform.lazy_memory import shared_zeroed

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, block_size=4, head_dim=3, dtype="float32")
NUM_BLOCKS = 8
SECRET = "test-cluster-secret"
KEY = FrameKey(SECRET)


def _cache(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.block_shape(NUM_BLOCKS), generator=generator)


def _reader(cache: torch.Tensor):  # noqa: ANN202
    return lambda ids: cache.index_select(3, torch.tensor(ids, dtype=torch.long))


@pytest.fixture
def source_cache() -> torch.Tensor:
    return _cache(0)


@pytest.fixture
def source(source_cache: torch.Tensor) -> KVSource:
    src = KVSource(_reader(source_cache), LAYOUT, SECRET)
    yield src
    src.close()


def _held(source: KVSource, block_ids: list[int], timeout: float = 30, lease_id: str = "t1") -> KVTransferHandle:
    """Lease the blocks as the prefill side's scheduler would, and build their handle."""
    hashes = [100 + i for i in range(len(block_ids))]
    source.hold(lease_id, block_ids, hashes, timeout)
    return KVTransferHandle(lease_id, source.host, source.port, hashes, timeout)


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
    data = TcpTransport(KEY, LAYOUT).fetch(KVTransferHandle.from_json(handle.to_json()), [0, 2], timeout=5)
    assert torch.equal(data, source_cache.index_select(3, torch.tensor([5, 7])))
    assert source.blocks_sent == 2


def test_a_bfloat16_cache_travels_over_tcp_and_shared_memory() -> None:
    """numpy has no bfloat16: both transports move raw bytes and view them as the cache's dtype."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, block_size=4, head_dim=3, dtype="bfloat16")
    path = f"/dev/shm/tandem-test-{uuid.uuid4().hex[:8]}"
    cache = shared_zeroed(path, layout.block_shape(NUM_BLOCKS), torch.bfloat16)
    cache.copy_(_cache(4).to(torch.bfloat16))
    source = KVSource(_reader(cache), layout, SECRET, shm_path=path, shm_num_blocks=NUM_BLOCKS)
    try:
        source.hold("bf", [6, 1], [1, 2], 30)
        handle = KVTransferHandle("bf", source.host, source.port, [1, 2])
        expected = cache.index_select(3, torch.tensor([6, 1]))
        assert torch.equal(TcpTransport(KEY, layout).fetch(handle, [0, 1], timeout=5), expected)
        shm = ShmTransport(KEY, layout)
        assert torch.equal(shm.fetch(handle, [0, 1], timeout=5), expected)
        assert shm.last_transport == "shm"
    finally:
        source.close()
        os.unlink(path)


def test_a_reader_whose_keys_hold_other_divisors_refuses_the_blocks(source: KVSource) -> None:
    """A source's cache holds k/s for its model's key divisors (models/key_divisors.py): a
    reader that folded other ones (or none) would misread every key, so it fetches nothing."""
    handle = _held(source, [1, 2])
    other = dataclasses.replace(LAYOUT, key_divisors="0123456789abcdef")
    with pytest.raises(KVTransferError, match="layout"):
        TcpTransport(KEY, other).fetch(handle, [0, 1], timeout=5)
    assert LAYOUT.writer(other.__dict__) is None
    assert LAYOUT.writer(dataclasses.replace(LAYOUT, dtype="uint8").__dict__) is not None


def test_unknown_lease_and_bad_index_are_refused(source: KVSource) -> None:
    handle = _held(source, [1])
    transport = TcpTransport(KEY, LAYOUT)
    with pytest.raises(KVTransferError, match="out of range"):
        transport.fetch(handle, [3], timeout=5)
    other = KVTransferHandle("nope", handle.host, handle.port, [1])
    with pytest.raises(KVTransferError, match="unknown or expired"):
        transport.fetch(other, [0], timeout=5)


def test_corrupted_payload_fails_the_checksum(source: KVSource) -> None:
    handle = _held(source, [1, 2])
    source.fault = "corrupt"
    with pytest.raises(KVTransferError, match="checksum"):
        TcpTransport(KEY, LAYOUT).fetch(handle, [0, 1], timeout=5)


def test_a_payload_with_a_non_finite_scale_is_a_failed_pull() -> None:
    """A source whose blocks hold a NaN sends an int8 payload whose scale is NaN under a
    matching digest: the reader refuses it (it would decode into NaN keys and values) as a
    failed pull, which the decode worker answers with a local prefill."""
    cache = _cache(0)
    cache[0, 0, 0, 2, 1, 0] = float("nan")  # layer 0's keys, head 0, block 2, row 1
    src = KVSource(_reader(cache), LAYOUT, SECRET)
    try:
        handle = _held(src, [2, 3])
        with pytest.raises(KVTransferError, match="non-finite scale"):
            TcpTransport(KEY, LAYOUT, KVCodec("int8")).fetch(handle, [0, 1], timeout=5)
        assert TcpTransport(KEY, LAYOUT).fetch(handle, [0, 1], timeout=5).isnan().sum() == 1  # raw: data
    finally:
        src.close()


def test_unreachable_source_times_out() -> None:
    handle = KVTransferHandle("t", "127.0.0.1", 9, [1])  # discard port: nobody answers
    started = time.monotonic()
    with pytest.raises(KVTransferError):
        TcpTransport(KEY, LAYOUT).fetch(handle, [0], timeout=0.5)
    assert time.monotonic() - started < 5


def test_sink_writes_blocks_then_the_release_ends_the_lease(source: KVSource, source_cache: torch.Tensor) -> None:
    handle = _held(source, [3, 4])
    target = torch.zeros(LAYOUT.block_shape(NUM_BLOCKS))
    sink = KVSink(lambda ids, data: target.index_copy_(3, torch.tensor(ids), data), LAYOUT, SECRET, fetch_timeout=5)
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

    source = KVSource(slow_read, LAYOUT, SECRET)
    target = torch.zeros(LAYOUT.block_shape(NUM_BLOCKS))
    sink = KVSink(lambda ids, data: target.index_copy_(3, torch.tensor(ids), data), LAYOUT, SECRET,
                  fetch_timeout=5, use_shm=False)
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
    source = KVSource(_reader(source_cache), LAYOUT, SECRET)
    try:
        handle = _held(source, [1, 2], timeout=0.2)
        assert source.finished() == []
        time.sleep(0.3)
        with pytest.raises(KVTransferError, match="unknown or expired"):
            TcpTransport(KEY, LAYOUT).fetch(handle, [0, 1], timeout=5)
        assert source.finished() == ["t1"] and source.num_held == 0
        assert source.finished() == []  # reported once
    finally:
        source.close()


def test_shared_memory_copy_is_confirmed_against_the_lease() -> None:
    """A same-host reader copies straight from the source's file, which the source names from
    its own record of the lease; if the lease ended before the copy was confirmed, the blocks
    may have been reused, so the copy is refused."""
    path = f"/dev/shm/tandem-test-{uuid.uuid4().hex[:8]}"
    cache = shared_zeroed(path, LAYOUT.block_shape(NUM_BLOCKS), torch.float32)
    cache.copy_(_cache(1))
    source = KVSource(_reader(cache), LAYOUT, SECRET, shm_path=path, shm_num_blocks=NUM_BLOCKS)
    try:
        shm = ShmTransport(KEY, LAYOUT)
        handle = _held(source, [2, 5], timeout=30, lease_id="live")
        assert torch.equal(shm.fetch(handle, [0, 1], timeout=5), cache.index_select(3, torch.tensor([2, 5])))
        assert shm.last_transport == "shm" and source.blocks_sent == 0  # no bytes over the port
        expiring = _held(source, [3], timeout=0.1, lease_id="old")
        time.sleep(0.2)
        cache[:, :, :, 3] = 7.0  # the block was freed and another request wrote it
        with pytest.raises(KVTransferError, match="unknown or expired"):
            shm.fetch(expiring, [0], timeout=5)
    finally:
        source.close()
        os.unlink(path)


def test_a_source_without_a_file_answers_a_shared_memory_reader_with_bytes(source: KVSource,
                                                                            source_cache: torch.Tensor) -> None:
    shm = ShmTransport(KEY, LAYOUT)
    data = shm.fetch(_held(source, [4]), [0], timeout=5)
    assert torch.equal(data, source_cache.index_select(3, torch.tensor([4])))
    assert shm.last_transport == "tcp"


def test_handle_round_trips_through_json_and_refuses_malformed_ones(source: KVSource) -> None:
    handle = _held(source, [0, 1])
    again = KVTransferHandle.from_json(handle.to_json())
    assert again == handle
    good = handle.to_json()
    for bad in ({"transfer_id": "x"}, {**good, "port": 0}, {**good, "port": True}, {**good, "block_hashes": [-1]},
                {**good, "block_hashes": [1 << 64]}, {**good, "transfer_id": "x" * 200},
                {**good, "expires_in": float("nan")}, [1, 2]):
        with pytest.raises(KVTransferError):
            KVTransferHandle.from_json(bad)  # type: ignore[arg-type]
    # A handle names a lease, never where the blocks lie: old fields are ignored.
    legacy = {**good, "shm_path": "/dev/shm/victim", "extra": {"block_ids": [0, 1]}}
    assert KVTransferHandle.from_json(legacy) == handle


def test_a_latent_cache_travels_as_one_plane_of_one_head() -> None:
    """MLA caches one latent per token (config.KVCacheSpec num_planes 1): same transport."""
    latent = KVLayout(num_layers=2, num_kv_heads=1, block_size=4, head_dim=9, dtype="float32", num_planes=1)
    assert latent.block_shape(3) == (2, 1, 1, 3, 4, 9)
    cache = torch.randn(latent.block_shape(NUM_BLOCKS), generator=torch.Generator().manual_seed(3))
    source = KVSource(_reader(cache), latent, SECRET)
    try:
        source.hold("lat", [4, 1], [7, 8], 30)
        handle = KVTransferHandle("lat", source.host, source.port, [7, 8])
        data = TcpTransport(KEY, latent).fetch(KVTransferHandle.from_json(handle.to_json()), [0, 1], timeout=5)
        assert torch.equal(data, cache.index_select(3, torch.tensor([4, 1])))
        with pytest.raises(KVTransferError, match="body|layout"):  # a reader with the K/V layout
            TcpTransport(KEY, LAYOUT).fetch(handle, [0], timeout=5)
    finally:
        source.close()


def test_a_source_serves_only_peers_that_sign_with_the_cluster_secret(source: KVSource) -> None:
    """A reader with a wrong secret is refused; the source counts it."""
    handle = _held(source, [0, 1], lease_id="lease-1")
    with pytest.raises(KVTransferError, match="cluster secret|bad reply"):
        TcpTransport(FrameKey("guess"), LAYOUT).fetch(handle, [0], timeout=5)
    with pytest.raises(KVTransferError):
        tcp.check(handle, FrameKey("guess"), timeout=5)
    assert source.refused == 2
    tcp.check(handle, KEY, timeout=5)  # the right one still works
    assert source.num_held == 1  # the refused requests released nothing


def test_a_stale_or_replayed_request_is_refused(source: KVSource) -> None:
    """A captured request does not verify again: its stamp ages out, its nonce is spent."""
    _held(source, [0], lease_id="lease-2")
    frames = []
    for stamp, nonce in ((time.time() - 600, "a" * 32), (time.time(), "b" * 32), (time.time(), "b" * 32)):
        with socket.create_connection((source.host, source.port), timeout=5) as sock:
            send_frame(sock, KEY, CHECK, {"transfer_id": "lease-2", "to": source.address, "ts": stamp,
                                          "nonce": nonce})
            frames.append(recv_frame(sock, KEY))
    assert "stale" in frames[0].header["message"]
    assert frames[1].header == {"re": "b" * 32}  # OK
    assert "replayed" in frames[2].header["message"]


def test_a_request_addressed_to_another_source_is_refused(source: KVSource) -> None:
    """A peer's signed request that went to an attacker's address (a forged handle) cannot be
    relayed to the real source: it names the address it was sent to."""
    _held(source, [0], lease_id="lease-3")
    with socket.create_connection((source.host, source.port), timeout=5) as sock:
        send_frame(sock, KEY, CHECK, {"transfer_id": "lease-3", "to": "127.0.0.1:9", "ts": time.time(),
                                      "nonce": "d" * 32})
        reply = recv_frame(sock, KEY)
    assert "addressed to" in reply.header["message"]


def test_a_reader_adopts_nothing_from_a_listener_without_the_secret() -> None:
    """The attack: a handle pointing at an attacker's listener that answers the lease check with
    OK and FETCH with random blocks. Its frames carry no valid MAC, so nothing is accepted."""
    forged_key = FrameKey("attacker-guess")
    payload = torch.randn(LAYOUT.block_shape(1)).numpy().tobytes()
    for body in (b"", payload):
        # A well-formed frame, signed with the wrong key, claiming to answer anything.
        a, b = socket.socketpair()
        header = {"re": "x", "indices": [0], "block_hashes": [100], "layout": LAYOUT.__dict__,
                  "shape": list(LAYOUT.block_shape(1)), "nbytes": len(body)}
        send_frame(a, forged_key, 0x80, header, memoryview(body) if body else None)
        a.close()
        reply = b.recv(1 << 20)
        b.close()
        attacker = Listener(reply)
        try:
            handle = KVTransferHandle("victim-lease", "127.0.0.1", attacker.port, [100])
            with pytest.raises(KVTransferError, match="cluster secret|bad reply"):
                TcpTransport(KEY, LAYOUT).fetch(handle, [0], timeout=5)
            with pytest.raises(KVTransferError):
                tcp.check(handle, KEY, timeout=5)
            assert attacker.contacts == 2
        finally:
            attacker.close()


def test_an_unauthenticated_huge_frame_costs_the_source_no_memory(source: KVSource) -> None:
    """A frame declaring a 400 MiB header (or body) is cut off after its 52-byte preamble: the
    source never reads, let alone allocates, what it declares. Before, one such frame cost the
    prefill worker its size in memory."""
    rss_before = psutil.Process().memory_info().rss
    for head_len, body_len in ((400 << 20, 0), (64, 400 << 20)):
        with socket.create_connection((source.host, source.port), timeout=5) as sock:
            sock.sendall(struct.pack("<4sB3xIQ", MAGIC, CHECK, head_len, body_len) + b"\0" * 32)
            try:
                for _ in range(64):  # stream junk: the source must close on us, not buffer it
                    sock.sendall(b"\0" * (1 << 20))
            except OSError:
                pass  # closed by the source: what we want
            else:
                sock.settimeout(5)
                assert sock.recv(1 << 16) is not None
    assert psutil.Process().memory_info().rss - rss_before < 64 << 20
    handle = _held(source, [0])
    tcp.check(handle, KEY, timeout=5)  # and it still serves its peers


def test_a_source_refuses_a_request_body(source: KVSource) -> None:
    """Requests carry no body: a signed request that declares one is refused unread."""
    with socket.create_connection((source.host, source.port), timeout=5) as sock:
        send_frame(sock, KEY, CHECK, {"transfer_id": "x", "ts": time.time(), "nonce": "c" * 32},
                   memoryview(b"\0" * 1024))
        reply = recv_frame(sock, KEY)
    assert "body" in reply.header["message"]
