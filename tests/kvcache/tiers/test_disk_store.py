"""The disk tier's store on real files: round trips, atomic commits, the LRU budget, what
survives a restart, files changed behind its back, and many threads at once."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest

from tandem.kvcache.tiers.chunk import chunk_key
from tandem.kvcache.tiers.disk import MARKER, DiskStore, file_name, key_of
from tandem.kvcache.tiers.store import ChunkStoreError


def chunk_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"))


def any_key(key: str) -> bool:
    return True


def open_store(path: Path, capacity_bytes: int, **kwargs) -> DiskStore:
    """A store over arbitrary keys (the default accepts only chunk keys, tiers/chunk.py):
    these tests are about the store's mechanics, not about which keys it recognises."""
    return DiskStore(path, capacity_bytes, valid_key=any_key, **kwargs)


def test_put_get_exists_delete(tmp_path: Path) -> None:
    store = open_store(tmp_path, 1 << 20)
    assert store.medium == "disk"
    store.put("3f2a-16b-r0of1", b"x" * 100)
    store.put("wide", memoryview(bytearray(range(8))).cast("H"))  # counted in bytes, not items
    assert store.get("3f2a-16b-r0of1") == b"x" * 100
    assert store.get("wide") == bytes(range(8))
    assert store.get("absent") is None
    assert store.exists(["3f2a-16b-r0of1", "absent", "wide"]) == [True, False, True]
    assert store.exists([]) == []
    prober = DiskStore.prober(tmp_path, valid_key=any_key)  # another view
    assert prober.exists(["3f2a-16b-r0of1"]) == [True]
    store.delete("3f2a-16b-r0of1")
    store.delete("absent")  # a no-op
    assert store.get("3f2a-16b-r0of1") is None
    stats = store.stats()
    assert stats["bytes_used"] == 8 and stats["num_chunks"] == 1
    assert (stats["puts"], stats["gets"], stats["hits"]) == (2, 4, 2)
    with pytest.raises(ChunkStoreError):
        DiskStore.prober(tmp_path, valid_key=any_key).put("k", b"v")


def test_keys_map_to_distinct_safe_file_names(tmp_path: Path) -> None:
    keys = ["tandem:kv:3f2a:16b:0of1", "a/b", "a_b", "a:b", "..", ".tmp-x", "ключ", "A-z09"]
    store = open_store(tmp_path, 1 << 20)
    for n, key in enumerate(keys):
        store.put(key, bytes([n]) * 10)
    for n, key in enumerate(keys):
        assert store.get(key) == bytes([n]) * 10
        assert key_of(file_name(key)) == key
    files = chunk_files(tmp_path)
    assert len(files) == len(keys)
    assert all(f.parent.parent == tmp_path and not f.name.startswith(".") for f in files)
    assert file_name("3f2a0011-16b-r0of1") == "3f2a0011-16b-r0of1"  # chunk keys stay readable
    assert len({f.parent for f in files}) > 1  # sharded by a hash, not by the key's prefix
    with pytest.raises(ValueError):
        file_name("k" * 300)


def test_a_temporary_file_is_never_a_chunk_and_a_stale_one_is_removed_on_restart(
        tmp_path: Path) -> None:
    store = open_store(tmp_path, 1000)
    store.put("a1", b"1" * 100)
    shard = store.path_for("a1").parent
    stale = shard / f".tmp-{uuid.uuid4().hex}"  # what a crash between write and rename leaves
    stale.write_bytes(b"half a chunk")
    os.utime(stale, (time.time() - 3600,) * 2)
    fresh = shard / f".tmp-{uuid.uuid4().hex}"  # another process writing right now
    fresh.write_bytes(b"in progress")
    assert store.stats()["num_chunks"] == 1
    again = open_store(tmp_path, 1000)
    assert again.get("a1") == b"1" * 100
    assert again.stats()["bytes_used"] == 100 and again.stats()["num_chunks"] == 1
    assert not stale.exists() and fresh.exists()


def test_budget_evicts_least_recently_used(tmp_path: Path) -> None:
    store = open_store(tmp_path, 300)
    for key in ("a1", "b2", "c3"):
        store.put(key, b"v" * 100)
    assert store.get("a1") is not None  # a hit: b2 is now the least recently used
    store.put("d4", b"v" * 100)
    assert store.exists(["a1", "b2", "c3", "d4"]) == [True, False, True, True]
    store.put("c3", b"w" * 100)  # rewriting a key replaces it: nothing evicted
    assert store.exists(["a1", "c3", "d4"]) == [True, True, True]
    store.put("e5", b"v" * 200)  # needs two: a1, then d4 (c3 was just written)
    assert store.exists(["a1", "c3", "d4", "e5"]) == [False, True, False, True]
    assert store.drain_evicted() == ["b2", "a1", "d4"] and store.drain_evicted() == []
    stats = store.stats()
    assert stats["evictions"] == 3 and stats["bytes_used"] == 300 and stats["num_chunks"] == 2
    assert sum(f.stat().st_size for f in chunk_files(tmp_path)) == 300


def test_a_value_larger_than_the_budget_is_refused(tmp_path: Path) -> None:
    store = open_store(tmp_path, 300)
    store.put("a1", b"v" * 100)
    store.put("big", b"v" * 301)  # not stored, and nothing evicted for it
    assert store.exists(["a1", "big"]) == [True, False]
    assert store.stats()["refused"] == 1 and store.stats()["evictions"] == 0
    store.put("full", b"v" * 300)  # exactly the budget: stored, a1 evicted
    assert store.exists(["a1", "full"]) == [False, True]


def test_restart_keeps_chunks_and_a_smaller_budget_evicts_oldest_first(tmp_path: Path) -> None:
    store = open_store(tmp_path, 1000)
    for n, key in enumerate(("a1", "b2", "c3")):
        store.put(key, bytes([n]) * 100)
        os.utime(store.path_for(key), (1000 + n, 1000 + n))  # written in this order
    store.close()
    again = open_store(tmp_path, 1000)
    assert again.stats()["bytes_used"] == 300 and again.stats()["num_chunks"] == 3
    assert [again.get(k) for k in ("a1", "b2", "c3")] == [bytes([n]) * 100 for n in range(3)]
    shrunk = open_store(tmp_path, 150)
    assert shrunk.exists(["a1", "b2", "c3"]) == [False, False, True]
    assert shrunk.drain_evicted() == ["a1", "b2"]
    assert shrunk.stats()["bytes_used"] == 100
    assert len(chunk_files(tmp_path)) == 1


def test_a_file_removed_behind_its_back_is_a_miss(tmp_path: Path) -> None:
    store = open_store(tmp_path, 1000)
    store.put("a1", b"1" * 100)
    os.unlink(store.path_for("a1"))  # another process, or an operator
    assert store.exists(["a1"]) == [False]
    assert store.get("a1") is None
    assert store.stats()["bytes_used"] == 0 and store.stats()["num_chunks"] == 0


def test_a_file_written_by_another_process_is_seen(tmp_path: Path) -> None:
    store = open_store(tmp_path, 1000)
    other = open_store(tmp_path, 1000)  # a second writer on the same directory
    other.put("a1", b"1" * 100)
    assert store.exists(["a1"]) == [True] and store.get("a1") == b"1" * 100


def test_corrupt_bytes_are_returned_as_they_are(tmp_path: Path) -> None:
    # The store is byte-level: checking a value is the chunk layer's job (its checksum).
    store = open_store(tmp_path, 1000)
    store.put("a1", b"1" * 100)
    path = store.path_for("a1")
    path.write_bytes(b"1" * 40 + b"\xff" + b"1" * 10)  # flipped and truncated
    assert store.get("a1") == b"1" * 40 + b"\xff" + b"1" * 10


def test_io_failures_are_store_errors(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ChunkStoreError):
        open_store(blocker / "tier", 1000)
    store = open_store(tmp_path / "tier", 1000)
    store.path_for("a1").mkdir(parents=True)  # a directory where the chunk's file should be
    with pytest.raises(ChunkStoreError):
        store.get("a1")
    with pytest.raises(ChunkStoreError):
        store.put("a1", b"v")
    assert store.stats()["errors"] == 2
    assert not list(store.path_for("a1").parent.glob(".tmp-*"))  # the failed put cleaned up


def test_fsync_mode_round_trips(tmp_path: Path) -> None:
    store = open_store(tmp_path, 1000, fsync=True)
    store.put("a1", b"1" * 100)
    assert store.get("a1") == b"1" * 100


def test_threads_never_see_a_torn_value_and_the_budget_holds(tmp_path: Path) -> None:
    budget = 20 * 1000  # about half the working set: evictions race with reads
    store = open_store(tmp_path, budget)
    errors: list[str] = []

    def value(version: int) -> bytes:
        # every byte the version, and a length only this version has: a torn read shows
        return bytes([version]) * (500 + version)

    def check(key: str, got: bytes | None) -> None:
        if got is not None and (len(set(got)) != 1 or len(got) != 500 + got[0]):
            errors.append(f"{key}: {len(got)} bytes, first {got[0]}")

    def writer(worker: int) -> None:
        for i in range(150):
            key = f"k{(worker * 7 + i) % 60:02d}"
            store.put(key, value((worker * 1000 + i) % 251))
            check(key, store.get(key))

    def reader() -> None:
        for i in range(600):
            key = f"k{i % 60:02d}"
            check(key, store.get(key))
            store.exists([key])

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    stats = store.stats()
    assert 0 < stats["bytes_used"] <= budget and stats["evictions"] > 0
    files = chunk_files(tmp_path)
    assert sum(f.stat().st_size for f in files) == stats["bytes_used"]
    assert len(files) == stats["num_chunks"]
    assert not list(tmp_path.rglob(".tmp-*"))


def test_the_directory_is_claimed_with_a_marker_and_reopened_by_it(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1000)  # an empty directory: claimed
    marker = tmp_path / MARKER
    assert json.loads(marker.read_text()) == {"owner": "tandem-kv-tier", "format": 1}
    assert [p.name for p in tmp_path.iterdir()] == [MARKER]  # no temporary file left
    key = chunk_key(0x3F2A, 16)
    store.put(key, b"v" * 10)
    assert DiskStore(tmp_path, 1000).get(key) == b"v" * 10  # ours: used as it is
    for body, why in ((b'{"owner": "tandem-kv-tier", "format": 2}', "format 2"),
                      (b'{"owner": "someone-else", "format": 1}', "not a tandem KV tier marker"),
                      (b"\x00garbage", "not JSON")):
        marker.write_bytes(body)
        with pytest.raises(ChunkStoreError, match=f"{MARKER} marker that is .*{why}"):
            DiskStore(tmp_path, 1000)
        assert marker.read_bytes() == body and store.path_for(key).is_file()
    marker.unlink()
    os.symlink(tmp_path / "elsewhere", marker)  # a link, even to a valid marker, is not ours
    (tmp_path / "elsewhere").write_text('{"owner": "tandem-kv-tier", "format": 1}')
    with pytest.raises(ChunkStoreError, match="a symbolic link"):
        DiskStore(tmp_path, 1000)
    assert DiskStore.prober(tmp_path).exists([key]) == [False]  # nor for a prober


def test_only_chunk_keys_are_stored_by_default(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1000)
    with pytest.raises(ChunkStoreError, match="not a key this tier stores"):
        store.put("a1", b"v")
    (tmp_path / "zz").mkdir()
    foreign = tmp_path / "zz" / "a1.kv"
    foreign.write_bytes(b"foreign")
    path = store.path_for("a1")  # where such a key would live: a file someone put there
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"foreign")
    assert store.get("a1") is None and store.exists(["a1"]) == [False]
    store.delete("a1")  # a no-op
    assert path.read_bytes() == b"foreign" and foreign.read_bytes() == b"foreign"


def test_a_chunk_name_that_is_not_a_regular_file_is_never_read(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1000)
    key = chunk_key(0x3F2A, 16)
    path = store.path_for(key)
    path.parent.mkdir()
    os.mkfifo(path)  # opening it for reading would block without O_NONBLOCK
    assert store.exists([key]) == [False]
    with pytest.raises(ChunkStoreError, match="not a regular file"):
        store.get(key)
    store.delete(key)  # not a file it wrote: left alone
    assert path.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_stale_temporary_file_of_another_user_is_left_alone(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1000)
    store.put(chunk_key(1, 1), b"v")
    theirs = store.path_for(chunk_key(1, 1)).parent / f".tmp-{uuid.uuid4().hex}"
    theirs.write_bytes(b"theirs")
    os.chown(theirs, 12345, 12345)
    os.utime(theirs, (time.time() - 3600,) * 2)
    DiskStore(tmp_path, 1000)
    assert theirs.read_bytes() == b"theirs"
