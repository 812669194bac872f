"""The disk tier's store: atomic commits, LRU under a budget, what survives a restart."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tandem.kvcache.tiers.disk import DiskStore
from tandem.kvcache.tiers.store import ChunkStoreError


def test_put_get_exists_delete(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    store.put("aa-1", b"x" * 100)
    assert store.get("aa-1") == b"x" * 100
    assert store.exists(["aa-1", "bb-2"]) == [True, False]
    assert DiskStore.prober(tmp_path).exists(["aa-1"]) == [True]  # another process's view
    store.delete("aa-1")
    assert store.get("aa-1") is None and store.stats()["bytes_used"] == 0


def test_budget_evicts_least_recently_used(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 300)
    for key in ("a1", "b2", "c3"):
        store.put(key, b"v" * 100)
    store.get("a1")  # now b2 is the oldest
    store.put("d4", b"v" * 100)
    assert store.exists(["a1", "b2", "c3", "d4"]) == [True, False, True, True]
    assert store.drain_evicted() == ["b2"] and store.stats()["evictions"] == 1
    store.put("e5", b"v" * 1000)  # larger than the whole budget: refused, nothing evicted
    assert store.exists(["e5"]) == [False] and store.stats()["refused"] == 1


def test_restart_finds_committed_chunks_and_drops_temporary_files(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1000)
    store.put("a1", b"1" * 100)
    store.put("b2", b"2" * 100)
    os.utime(store._path(store._name("a1")), (1, 1))  # a1 is the oldest on disk
    stale = tmp_path / "a1" / ".tmp-crashed"
    stale.write_bytes(b"half a chunk")
    again = DiskStore(tmp_path, 1000)
    assert again.get("b2") == b"2" * 100 and not stale.exists()
    shrunk = DiskStore(tmp_path, 150)  # the budget shrank: oldest first
    assert shrunk.exists(["a1", "b2"]) == [False, True]


def test_a_file_deleted_behind_its_back_is_a_miss(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1000)
    store.put("a1", b"1" * 100)
    os.unlink(store._path(store._name("a1")))
    assert store.get("a1") is None and store.stats()["bytes_used"] == 0


def test_concurrent_writers_and_readers(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 40 * 1000)
    errors: list[str] = []

    def work(worker: int) -> None:
        for i in range(50):
            key = f"k{(worker * 7 + i) % 60:02d}"
            value = key.encode() * 250
            store.put(key, value)
            got = store.get(key)
            if got is not None and bytes(got) != value:
                errors.append(key)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert store.stats()["bytes_used"] <= 40 * 1000
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))
    assert on_disk == store.stats()["bytes_used"]


def test_an_unwritable_directory_is_a_store_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ChunkStoreError):
        DiskStore(blocker / "tier", 1000)
