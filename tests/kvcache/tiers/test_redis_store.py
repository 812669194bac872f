"""The cluster tier's store against a real redis-server: round trips, LRU under maxmemory, and
a server that stops mid-run (errors, bounded by timeouts, then recovery)."""

from __future__ import annotations

import time

import pytest

from tandem.kvcache.tiers.redis_server import RedisServer
from tandem.kvcache.tiers.redis_store import RedisStore
from tandem.kvcache.tiers.store import ChunkStoreError


def test_round_trip(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, prefix="test-rt:")
    store.put("a1", b"x" * 1000)
    assert store.get("a1") == b"x" * 1000
    assert store.exists(["a1", "nope"]) == [True, False]
    store.delete("a1")
    assert store.get("a1") is None
    valkey = RedisStore(redis_server.url.replace("redis://", "valkey://"), prefix="test-rt:")
    valkey.put("v", memoryview(b"abc"))
    assert valkey.get("v") == b"abc"
    assert store.stats()["puts"] == 1 and store.stats()["hits"] == 1


def test_maxmemory_evicts_old_chunks_instead_of_failing() -> None:
    with RedisServer(maxmemory_bytes=8 << 20) as server:
        store = RedisStore(server.url)
        for i in range(20):
            store.put(f"k{i}", bytes(1 << 20))
        present = store.exists([f"k{i}" for i in range(20)])
        assert present[-1] and not all(present)


def test_a_stopped_server_is_an_error_then_recovers() -> None:
    server = RedisServer().start()
    port = server.port
    store = RedisStore(server.url, backoff_s=0.5)
    store.put("a", b"1")
    server.stop()
    started = time.monotonic()
    with pytest.raises(ChunkStoreError):
        store.get("a")
    with pytest.raises(ChunkStoreError, match="backing off"):
        store.exists(["a"])
    assert time.monotonic() - started < 3
    with RedisServer(port=port):
        time.sleep(0.6)
        assert store.get("a") is None  # a fresh, empty server
        store.put("a", b"2")
        assert store.get("a") == b"2"


def test_server_process_is_gone_after_stop() -> None:
    server = RedisServer().start()
    pid = server.process.pid
    server.stop()
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)
