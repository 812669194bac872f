"""The local-disk KV tier: one file per chunk under a byte budget, least recently used evicted.

Why one file per chunk rather than a preallocated slab: the file system already is an
allocator, a rename is an atomic commit, and a restart finds every committed chunk again by
listing the directory. Layout: `<root>/<shard>/<name>.kv`, where `name` is the key with every
byte outside [A-Za-z0-9-] escaped as `_xx` (reversible, so two keys never share a file and a
restart recovers the keys), and `shard` is two hex digits of a hash of the key, so no
directory holds more than 1/256 of the chunks whatever the keys look like (a shard of
`key[:2]` would put every `tandem:kv:...` key in one directory).

A put writes `.tmp-<uuid>` in the chunk's directory and renames it over the final name
(`os.replace`, atomic on POSIX): a crash leaves a temporary file, never half a chunk under a
real name. No fsync by default: the tier is a cache, every value carries its own checksum
(chunk.py), and losing the page cache in a power cut costs recomputes, while an fsync per
10 MiB chunk costs the writer thread more than the tier saves. `fsync=True` syncs the file
before the rename and the directory after it.

The budget (`capacity_bytes`) is kept in memory: an LRU of key -> size, touched by puts and
hits. A put that would exceed it first deletes the least recently used files; a value larger
than the whole budget is refused (not stored, counted as `refused`; a put returns normally).
On construction the directory is scanned: `.tmp-*` files older than a minute (left by a
crash; younger ones may belong to another process writing now) are deleted, and `*.kv` files
are indexed oldest modification time first, so chunks survive a restart and the budget is
enforced again if it shrank. Reads do not touch modification times, so after a restart the
LRU order is the order of writes.

`get` reads the whole file with one `read()` into a new `bytes`. Measured on a 12 MiB file
from the page cache: 0.3 ms (about 35 GB/s) for `read()`, 0.7 ms for `readinto` a
preallocated `bytearray` (zero-filling the bytearray costs a pass over the memory); from the
disk (page cache dropped) both take 8-13 ms on this machine's virtual disk. The value may be
corrupt (another process, a bad disk): the store is byte-level and returns it as it is; the
chunk layer's checksum turns it into a miss.

Several processes may share a directory: `exists` and `get` ask the file system, so they see
chunks another process wrote; a file that vanished is a miss. Each process budgets only the
files it wrote or found at start, so give every writer its own directory (or its own share of
the budget) when more than one writes. `DiskStore.prober(path)` is a read-only view (no scan,
no eviction) for a process that only checks existence.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from tandem.kvcache.tiers.store import ChunkStore, ChunkStoreError

_SUFFIX = ".kv"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 60.0  # a temporary file older than this at start-up was left by a crash
_MAX_EVICTED = 65536  # evicted keys kept for drain_evicted() when nobody drains them
_MAX_NAME = 240  # bytes; file systems allow 255
_SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
_ALL_SAFE = re.compile(r"[A-Za-z0-9-]+")  # chunk keys (chunk.py) are: their name is the key


def file_name(key: str) -> str:
    """The file name (without suffix) of `key`: bytes outside [A-Za-z0-9-] become `_xx`."""
    if _ALL_SAFE.fullmatch(key):
        name = key
    else:
        name = "".join(chr(b) if b in _SAFE else f"_{b:02x}" for b in key.encode())
    if not name or len(name) + len(_SUFFIX) > _MAX_NAME:
        raise ValueError(f"disk tier: key of {len(key)} characters cannot be a file name")
    return name


def key_of(name: str) -> str | None:
    """The key a file name (without suffix) stands for, or None if it is not one of ours."""
    out = bytearray()
    i = 0
    try:
        while i < len(name):
            if name[i] == "_":
                out.append(int(name[i + 1:i + 3], 16))
                i += 3
            elif ord(name[i]) in _SAFE:
                out.append(ord(name[i]))
                i += 1
            else:
                return None
        key = out.decode()
        return key if file_name(key) == name else None  # one spelling per key
    except (ValueError, IndexError):
        return None


def shard_of(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=1).hexdigest()


class DiskStore(ChunkStore):
    medium = "disk"

    def __init__(self, path: str | Path, capacity_bytes: int, fsync: bool = False,
                 read_only: bool = False) -> None:
        self.root = Path(path)
        self.capacity_bytes = int(capacity_bytes)
        self.fsync = fsync
        self.read_only = read_only
        self._lock = threading.Lock()  # the index, the counters, and every commit or unlink
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> size, least recent first
        self._used = 0
        self._counters = {"puts": 0, "gets": 0, "hits": 0, "evictions": 0, "refused": 0,
                          "errors": 0}
        self._evicted: list[str] = []  # keys evicted since the last drain_evicted()
        if read_only:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as exc:
            raise ChunkStoreError(f"disk tier at {self.root}: {exc}") from exc
        with self._lock:
            self._evict_to(self.capacity_bytes)

    @classmethod
    def prober(cls, path: str | Path) -> DiskStore:
        """A read-only view of a directory another process writes: exists/get, no budget."""
        return cls(path, 0, read_only=True)

    def path_for(self, key: str) -> Path:
        """Where the chunk under `key` lives."""
        return self.root / shard_of(key) / (file_name(key) + _SUFFIX)

    # --- the interface ------------------------------------------------------------------
    def put(self, key: str, value: bytes | bytearray | memoryview) -> None:
        if self.read_only:
            raise ChunkStoreError(f"disk tier at {self.root} is open read-only")
        view = memoryview(value)
        size = view.nbytes
        if size > self.capacity_bytes:
            with self._lock:
                self._counters["refused"] += 1
            return
        path = self.path_for(key)
        tmp = path.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as handle:
                handle.write(view.cast("B") if view.format != "B" else view)
                if self.fsync:
                    handle.flush()
                    os.fsync(handle.fileno())
            with self._lock:
                self._evict_to(self.capacity_bytes - size, keep=key)
                os.replace(tmp, path)
                self._used += size - self._index.pop(key, 0)
                self._index[key] = size
                self._counters["puts"] += 1
            if self.fsync:
                _fsync_dir(path.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            with self._lock:
                self._counters["errors"] += 1
            raise ChunkStoreError(f"disk tier: cannot write {path}: {exc}") from exc

    def get(self, key: str) -> bytes | None:
        path = self.path_for(key)
        with self._lock:
            self._counters["gets"] += 1
        try:
            with open(path, "rb", buffering=0) as handle:
                data = handle.read()  # the whole file; faster than readinto (module docstring)
        except FileNotFoundError:
            with self._lock:  # evicted, or deleted behind our back: forget it
                if key in self._index and not path.exists():  # (a put may have just landed)
                    self._used -= self._index.pop(key)
            return None
        except OSError as exc:
            with self._lock:
                self._counters["errors"] += 1
            raise ChunkStoreError(f"disk tier: cannot read {path}: {exc}") from exc
        with self._lock:
            self._counters["hits"] += 1
            if key in self._index:
                self._index.move_to_end(key)
        return data

    def exists(self, keys: Sequence[str]) -> list[bool]:
        # The file system, not the index: another process may have written or deleted it.
        return [self.path_for(key).is_file() for key in keys]

    def delete(self, key: str) -> None:
        if self.read_only:
            raise ChunkStoreError(f"disk tier at {self.root} is open read-only")
        path = self.path_for(key)
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._counters["errors"] += 1
                raise ChunkStoreError(f"disk tier: cannot delete {path}: {exc}") from exc

    def drain_evicted(self) -> list[str]:
        """Keys the budget evicted since the last call (for the tiers' removal events)."""
        with self._lock:
            evicted, self._evicted = self._evicted, []
        return evicted

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"bytes_used": self._used, "num_chunks": len(self._index),
                    "capacity_bytes": self.capacity_bytes, **self._counters}

    # --- internals ----------------------------------------------------------------------
    def _scan(self) -> None:
        """Index the committed chunks, oldest first; delete temporary files left by a crash."""
        found: list[tuple[float, str, int]] = []
        stale_before = time.time() - _STALE_TMP_S
        for shard in os.scandir(self.root):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(shard.path):
                if entry.name.startswith(_TMP_PREFIX):
                    with contextlib.suppress(OSError):
                        if entry.stat().st_mtime < stale_before:
                            os.unlink(entry.path)
                    continue
                if not entry.name.endswith(_SUFFIX) or not entry.is_file(follow_symlinks=False):
                    continue
                key = key_of(entry.name[:-len(_SUFFIX)])
                if key is None or shard_of(key) != shard.name:
                    continue  # not a file this store wrote: leave it alone
                stat = entry.stat()
                found.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._used += size

    def _evict_to(self, limit: int, keep: str | None = None) -> None:
        """Delete least recently used chunks until at most `limit` bytes are used, not
        counting `keep` (the key being replaced). Lock held."""
        excess = self._used - (self._index.get(keep, 0) if keep is not None else 0) - max(0, limit)
        victims = []
        for key, size in self._index.items():
            if excess <= 0:
                break
            if key == keep:
                continue
            victims.append(key)
            excess -= size
        for key in victims:
            self._used -= self._index.pop(key)
            self._counters["evictions"] += 1
            self._evicted.append(key)
            try:
                os.unlink(self.path_for(key))
            except FileNotFoundError:
                pass
            except OSError:  # out of the budget all the same; the next scan retries
                self._counters["errors"] += 1
        del self._evicted[:-_MAX_EVICTED]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
