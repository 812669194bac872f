"""The local-disk KV tier owns its directory and touches nothing else in it.

tandem deletes files in the disk tier's directory (stale temporary files at start-up, chunks
over the budget) and often runs as root, so a wrong `--kv-offload-disk-path` (a scratch
directory, `/`) or a file someone drops into the tier's directory must never lose, index or
be read: a directory without the tier's marker is refused at start-up, and in an owned one
only names the tier itself makes count (tandem/kvcache/tiers/disk.py's docstring)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tandem.config import EngineConfig, KVTiersConfig
from tandem.kvcache.connector.tiers_worker import TiersConnectorWorker
from tandem.kvcache.tiers.chunk import chunk_key, is_chunk_key, parse_chunk_key
from tandem.kvcache.tiers.disk import MARKER, DiskStore, file_name, shard_of
from tandem.kvcache.tiers.store import ChunkStoreError
from tandem.platform.ports import free_port

HOUR_AGO = time.time() - 3600


def key(n: int) -> str:
    return chunk_key(0x1000 + n, 4)


def snapshot(root: Path) -> dict[str, tuple[str, bytes | str, float]]:
    """Every entry under `root`, without following links: kind, content or link target, and
    modification time (of files and links)."""
    out: dict[str, tuple[str, bytes | str, float]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            info = path.lstat()
            if path.is_symlink():
                out[str(path.relative_to(root))] = ("link", os.readlink(path), info.st_mtime)
            elif path.is_dir():  # (its modification time changes with its entries)
                out[str(path.relative_to(root))] = ("dir", "", 0.0)
            else:
                out[str(path.relative_to(root))] = ("file", path.read_bytes(), info.st_mtime)
    return out


def write(path: Path, data: bytes = b"foreign", old: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if old:
        os.utime(path, (HOUR_AGO, HOUR_AGO))
    return path


def test_a_non_empty_foreign_directory_is_refused_and_left_unchanged(tmp_path: Path) -> None:
    root = tmp_path / "scratch"
    write(root / "x.kv")
    write(root / "ab" / "zz.kv")
    write(root / "ab" / ".tmp-foo")
    write(root / "ab" / f".tmp-{uuid.uuid4().hex}")  # looks like ours, is not
    real = root / shard_of(key(1)) / (file_name(key(1)) + ".kv")  # a chunk's name, not ours
    write(real, b"x" * 1000)
    before = snapshot(root)
    with pytest.raises(ChunkStoreError) as info:
        DiskStore(root, 10)  # a budget that would evict every chunk it indexed
    message = str(info.value)
    assert str(root) in message and "not empty" in message and MARKER in message
    assert "--kv-offload-disk-path" in message and "empty or new directory" in message
    assert snapshot(root) == before
    assert not (root / MARKER).exists()


def test_a_file_is_refused_and_left_unchanged(tmp_path: Path) -> None:
    path = write(tmp_path / "notes.txt", b"keep me")
    with pytest.raises(ChunkStoreError, match=r"notes\.txt exists and is not a directory; give "
                                              r"--kv-offload-disk-path an empty or new directory"):
        DiskStore(path, 1000)
    assert path.read_bytes() == b"keep me" and path.stat().st_mtime == HOUR_AGO


def test_a_system_like_directory_is_refused(tmp_path: Path) -> None:
    # What `--kv-offload-disk-path /` meets (a copy of its shape: the real / is not touched).
    root = tmp_path / "fake-root"
    write(root / "etc" / "passwd", b"root:x:0:0::/root:/bin/sh\n")
    write(root / "etc" / f".tmp-{uuid.uuid4().hex}")
    write(root / "etc" / ".tmp-lock")
    write(root / "bin" / "sh", b"\x7fELF")
    (root / "tmp").mkdir()
    before = snapshot(root)
    with pytest.raises(ChunkStoreError, match="is not empty and was not created by tandem"):
        DiskStore(root, 1 << 20)
    assert snapshot(root) == before


def test_an_empty_directory_is_claimed_and_a_new_path_created(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    store = DiskStore(empty, 1 << 20)
    assert json.loads((empty / MARKER).read_text()) == {"owner": "tandem-kv-tier", "format": 1}
    store.put(key(1), b"1" * 100)
    assert store.get(key(1)) == b"1" * 100
    again = DiskStore(empty, 1 << 20)  # a restart: the marker is ours, the chunk found
    assert again.stats()["num_chunks"] == 1 and again.get(key(1)) == b"1" * 100
    fresh = tmp_path / "new" / "nested" / "tier"
    DiskStore(fresh, 1 << 20).put(key(2), b"2")
    assert (fresh / MARKER).is_file() and DiskStore(fresh, 1 << 20).get(key(2)) == b"2"


def test_files_dropped_into_an_owned_directory_are_never_indexed_read_or_deleted(
        tmp_path: Path) -> None:
    root = tmp_path / "tier"
    outside = tmp_path / "outside"
    store = DiskStore(root, 300)
    for n in range(3):
        store.put(key(n), bytes([n]) * 100)
        os.utime(store.path_for(key(n)), (1000 + n, 1000 + n))  # written in this order
    own_shards = {shard_of(key(n)) for n in range(5)}  # keys 3 and 4 are put below
    assert not own_shards & {shard_of(key(7)), shard_of(key(8)), shard_of("zz"), shard_of("foo")}
    # Names key_of decodes but that are no chunk keys, each in the shard it hashes to.
    write(root / shard_of("zz") / "zz.kv", b"z" * 500, old=False)
    write(root / shard_of("foo") / "foo.kv", b"f" * 500, old=False)
    write(root / "x.kv")
    write(root / "notes.txt")
    write(root / shard_of(key(0)) / ".tmp-foo")  # not what a put writes
    write(root / shard_of(key(0)) / "readme")
    # A chunk's name in a directory that is no shard (not two lowercase hex digits), and in
    # the wrong shard.
    write(root / "AB" / (file_name(key(5)) + ".kv"))
    write(root / "zzz" / f".tmp-{uuid.uuid4().hex}")
    wrong = "00" if shard_of(key(6)) != "00" else "01"
    write(root / wrong / (file_name(key(6)) + ".kv"))
    # A shard that is a symbolic link to a directory elsewhere, holding a chunk-named file of
    # that shard and a stale temporary file: neither is indexed, read or deleted.
    write(outside / (file_name(key(7)) + ".kv"), b"secret" * 100)
    write(outside / f".tmp-{uuid.uuid4().hex}")
    os.symlink(outside, root / shard_of(key(7)))
    # A chunk-named symbolic link in a real shard, pointing at a file elsewhere.
    target = write(outside / "target", b"target" * 100)
    (root / shard_of(key(8))).mkdir()
    os.symlink(target, root / shard_of(key(8)) / (file_name(key(8)) + ".kv"))
    own = {str(store.path_for(key(n)).relative_to(tmp_path)) for n in range(5)}
    foreign = {path: v for path, v in snapshot(tmp_path).items() if path not in own}

    again = DiskStore(root, 300)  # a restart over the same directory
    assert again.stats()["num_chunks"] == 3 and again.stats()["bytes_used"] == 300
    assert again.exists([key(0), key(7), key(8)]) == [True, False, False]
    for k in (key(7), key(8)):  # through a link: refused, never read
        with pytest.raises(ChunkStoreError, match="symbolic link"):
            again.get(k)
    again.delete(key(8))  # not ours: the link at its name stays
    again.put(key(3), b"3" * 200)  # over the budget: two of its own go, oldest first
    assert again.drain_evicted() == [key(0), key(1)]
    again.put(key(4), b"4" * 300)
    evicted = again.drain_evicted()
    assert evicted == [key(2), key(3)] and all(is_chunk_key(k) for k in evicted)
    assert [n for n in range(5) if again.path_for(key(n)).is_file()] == [4]
    assert again.stats()["num_chunks"] == 1 and again.stats()["errors"] == 2  # the two gets
    after = snapshot(tmp_path)  # every foreign entry is still there, unchanged
    assert {path: after.get(path) for path in foreign} == foreign


def test_a_prober_reads_nothing_in_a_directory_the_tier_does_not_own(tmp_path: Path) -> None:
    root = tmp_path / "scratch"
    chunk = write(root / shard_of(key(1)) / (file_name(key(1)) + ".kv"), b"foreign")
    before = snapshot(root)
    prober = DiskStore.prober(root)
    assert prober.exists([key(1)]) == [False] and prober.get(key(1)) is None
    assert snapshot(root) == before and chunk.read_bytes() == b"foreign"
    # A directory the writer claims after the prober opened it (the scheduler's prober is
    # opened before the worker's store) is seen once the marker is there.
    later = tmp_path / "later"
    prober = DiskStore.prober(later)
    assert prober.exists([key(1)]) == [False] and not later.exists()
    DiskStore(later, 1000).put(key(1), b"1")
    assert prober.exists([key(1)]) == [True] and prober.get(key(1)) == b"1"


def test_a_foreign_eviction_key_does_not_crash_the_worker() -> None:
    class Store:
        def stats(self) -> dict[str, float]:
            return {}

        def drain_evicted(self) -> list[str]:
            return ["zz", "not-a-hash", chunk_key(0xBEEF, 4), "ffff-4b-r0of1"]

    worker = TiersConnectorWorker(EngineConfig("m", kv_tiers=KVTiersConfig(disk_path="/unused")), 0)
    worker.stores = {"disk": Store()}  # type: ignore[dict-item]
    report = worker.get_finished().reports["tiers"]
    assert report["gone"] == [(0xBEEF, "disk")]


def test_chunk_keys_parse_and_nothing_else_does() -> None:
    assert parse_chunk_key(chunk_key(0xABC, 16)) == (0xABC, 16, 0, 1)
    assert parse_chunk_key(chunk_key(2**64 - 1, 4, 3, 4)) == (2**64 - 1, 4, 3, 4)
    for bad in ("", "zz", "foo", "abc-16b-r0of1", "0000000000000ABC-16b-r0of1",
                "0000000000000abc-0b-r0of1", "0000000000000abc-16b-r1of1",
                "0000000000000abc-016b-r0of1", "0000000000000abc-16b-r0of1.kv",
                "0000000000000abc-16b-r0of1\n", "tandem:kv:3f2a:16b:0of1"):
        assert parse_chunk_key(bad) is None and not is_chunk_key(bad), bad


def test_tandem_serve_refuses_a_foreign_disk_tier_directory(tmp_path: Path) -> None:
    root = tmp_path / "scratch"
    write(root / "x.kv")
    write(root / "ab" / f".tmp-{uuid.uuid4().hex}")
    before = snapshot(root)
    port = free_port()  # start-up fails before it binds
    command = [sys.executable, "-m", "tandem", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--kv-offload-disk-path", str(root), "--kv-offload-cpu-bytes", "64MiB"]
    # A session of its own: should it start after all, the engine core goes with it.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"tandem serve did not refuse to start within 180 s:\n{output[-3000:]}")
    assert process.returncode != 0, output[-3000:]
    assert f"disk tier: {root} is not empty and was not created by tandem" in output, output[-3000:]
    assert "Traceback" not in output  # refused before the model loads, in one line
    assert snapshot(root) == before
