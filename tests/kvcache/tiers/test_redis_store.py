"""The cluster tier's store against a real redis-server: round trips, URLs, LRU under
maxmemory, error replies, and a server that dies or hangs mid-run (errors bounded by the
timeouts, a back-off, then recovery on the same port)."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest
import redis

from tandem.kvcache.tiers.redis_store import RedisStore, normalize_url
from tandem.kvcache.tiers.store import ChunkStoreError
from tandem.launch.redis_server import RedisServer

pytestmark = pytest.mark.usefixtures("redis_binary")  # fails, not skips, without a server


def fresh_prefix() -> str:
    return f"test-{uuid.uuid4().hex[:8]}:"


def test_put_get_exists_delete(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, prefix=fresh_prefix())
    assert store.medium == "cluster"
    store.put("3f2a-16b-r0of1", b"x" * 1000)
    store.put("ba", bytearray(b"abc"))
    store.put("wide", memoryview(bytearray(range(8))).cast("H"))  # sent as its 8 bytes
    assert store.get("3f2a-16b-r0of1") == b"x" * 1000
    assert store.get("ba") == b"abc" and store.get("wide") == bytes(range(8))
    assert store.get("absent") is None
    assert store.exists(["3f2a-16b-r0of1", "absent", "ba"]) == [True, False, True]
    assert store.exists([]) == []
    store.delete("3f2a-16b-r0of1")
    store.delete("absent")  # a no-op
    assert store.get("3f2a-16b-r0of1") is None
    stats = store.stats()
    assert (stats["puts"], stats["gets"], stats["hits"], stats["errors"]) == (3, 5, 3, 0)
    assert stats["bytes_put"] == 1011 and stats["bytes_got"] == 1011
    store.close()


def test_prefix_url_schemes_and_ttl(redis_server: RedisServer) -> None:
    prefix = fresh_prefix()
    store = RedisStore(redis_server.url, prefix=prefix, ttl_s=60)
    store.put("k", b"v")
    raw = redis.Redis.from_url(redis_server.url)
    assert raw.get(prefix + "k") == b"v" and 0 < raw.ttl(prefix + "k") <= 60
    valkey = RedisStore(redis_server.url.replace("redis://", "valkey://"), prefix=prefix)
    assert valkey.get("k") == b"v"
    other_db = RedisStore(redis_server.url + "/3", prefix=prefix)
    assert other_db.get("k") is None
    other_db.put("k", b"db3")
    assert raw.get(prefix + "k") == b"v" and store.get("k") == b"v"
    assert normalize_url("valkeys://h:1/2") == "rediss://h:1/2"
    with pytest.raises(ValueError, match="Redis/Valkey URL"):
        RedisStore("http://localhost:6379")
    raw.close()


def test_a_12_mib_chunk_round_trips(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, prefix=fresh_prefix())
    value = os.urandom(12 << 20)
    store.put("big", value)
    assert store.get("big") == value
    store.delete("big")


def test_threads_share_one_store(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, prefix=fresh_prefix(), max_connections=4)
    errors: list[str] = []

    def work(worker: int) -> None:
        for i in range(100):
            key = f"k{(worker + i) % 20}"
            store.put(key, bytes([i % 251]) * (500 + i % 251))
            got = store.get(key)
            if got is None or len(set(got)) != 1 or len(got) != 500 + got[0]:
                errors.append(key)
            store.exists([key, "absent"])

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and store.stats()["errors"] == 0


def test_maxmemory_with_allkeys_lru_evicts_old_chunks_instead_of_failing() -> None:
    with RedisServer(maxmemory_bytes=8 << 20) as server:
        store = RedisStore(server.url)
        for i in range(20):
            store.put(f"k{i}", bytes(1 << 20))  # 20 MiB through an 8 MiB server
        present = store.exists([f"k{i}" for i in range(20)])
        assert present[-1] and not present[0] and sum(present) <= 8
        assert store.stats()["errors"] == 0


def test_an_error_reply_is_a_store_error_without_back_off() -> None:
    with RedisServer(maxmemory_bytes=4 << 20, policy="noeviction") as server:
        store = RedisStore(server.url)
        with pytest.raises(ChunkStoreError, match="maxmemory"):
            for i in range(10):
                store.put(f"k{i}", bytes(1 << 20))
        assert store.get("k0") == bytes(1 << 20)  # the server is up: no back-off
        assert store.stats()["errors"] == 1 and store.stats()["backoffs"] == 0


def test_no_server_is_a_store_error_not_a_hang() -> None:
    server = RedisServer().start()
    url = server.url
    server.stop()  # the port is now closed
    store = RedisStore(url, backoff_s=0.2)
    started = time.monotonic()
    with pytest.raises(ChunkStoreError, match="ConnectionError"):
        store.exists(["a"])
    assert time.monotonic() - started < 1


def test_a_stopped_server_is_an_error_then_the_store_recovers_after_the_back_off() -> None:
    server = RedisServer().start()
    port = server.port
    store = RedisStore(server.url, backoff_s=0.5)
    store.put("a", b"1")
    assert store.get("a") == b"1"  # the pool now holds a connection to this server
    server.stop()
    started = time.monotonic()
    with pytest.raises(ChunkStoreError):
        store.get("a")
    failed_at = time.monotonic()  # the back-off runs until at most failed_at + 0.5
    with pytest.raises(ChunkStoreError, match="backing off"):
        store.put("a", b"2")  # fails at once, without trying
    assert time.monotonic() - started < 1
    with RedisServer(port=port) as again:
        time.sleep(max(0.0, failed_at + 0.55 - time.monotonic()))
        assert store.get("a") is None  # a fresh, empty server
        store.put("a", b"2")
        assert store.get("a") == b"2"
        assert again.port == port
    stats = store.stats()
    assert stats["errors"] == 1 and stats["backoffs"] == 1


def test_a_hung_server_times_out_within_the_socket_timeout() -> None:
    with RedisServer() as server:
        store = RedisStore(server.url, socket_timeout=0.3, backoff_s=0.2)
        store.put("a", b"1")
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)  # alive, connected, silent
        try:
            started = time.monotonic()
            with pytest.raises(ChunkStoreError, match="Timeout"):
                store.get("a")
            assert time.monotonic() - started < 1.5
        finally:
            os.kill(server.pid, signal.SIGCONT)
        time.sleep(0.25)
        assert store.get("a") == b"1"


def test_sightings_are_counted_across_stores(redis_server: RedisServer) -> None:
    one, two = RedisStore(redis_server.url, prefix="test-seen:"), RedisStore(redis_server.url, prefix="test-seen:")
    assert one.count_sightings(["a", "b"]) == [1, 1]
    assert two.count_sightings(["b", "c"]) == [2, 1]
    assert one.count_sightings([]) == []
