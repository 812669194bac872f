"""The local-disk KV tier: one file per chunk under a byte budget, oldest evicted first.

Layout: `<dir>/<2 hex chars>/<key>.kv`, the two characters being the key's first, so no
directory grows past a few thousand entries. One file per chunk rather than a preallocated
slab: the file system already is an allocator, a crash can only leave a temporary file
behind (never half a chunk under a real name), and a restart finds every committed chunk again
by listing the directory. What survives a restart: every `*.kv` file, ordered for eviction by
its modification time (reads touch nothing on disk, so the order is that of writes); stale
`.tmp-*` files are deleted on start.

A put writes `.tmp-<uuid>` in the chunk's directory and renames it over the final name
(`os.replace` is atomic on POSIX), optionally after an fsync: off by default, because the tier
is a cache whose values carry their own checksum, and an fsync per 10 MiB chunk would cost
more than the tier saves. Reads go through the page cache; a chunk read soon after it was
written costs a memory copy.

The budget is kept by the process that writes (a worker). Other processes may open a
`prober` on the same directory: it only answers `exists`, by stat, and never evicts.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from tandem.kvcache.tiers.store import ChunkStore, ChunkStoreError

_SUFFIX = ".kv"
_TMP_PREFIX = ".tmp-"


def _safe_name(key: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in key)


class DiskStore(ChunkStore):
    medium = "disk"

    def __init__(self, path: str | Path, capacity_bytes: int, fsync: bool = False, read_only: bool = False) -> None:
        self.root = Path(path)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.read_only = read_only
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> size, oldest first
        self._used = 0
        self._counters = {"puts": 0, "gets": 0, "hits": 0, "evictions": 0, "refused": 0, "errors": 0}
        self.evicted: list[str] = []  # keys evicted since the last `drain_evicted`
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
        """A view of the directory for existence checks only (no scan, no eviction)."""
        return cls(path, 0, read_only=True)

    def _scan(self) -> None:
        found: list[tuple[float, str, int]] = []
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if entry.name.startswith(_TMP_PREFIX):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                elif entry.name.endswith(_SUFFIX):
                    stat = entry.stat()
                    found.append((stat.st_mtime, entry.name, stat.st_size))
        for _, name, size in sorted(found):
            self._index[name] = size
            self._used += size

    def _path(self, name: str) -> Path:
        return self.root / name[:2] / name

    def _name(self, key: str) -> str:
        return _safe_name(key) + _SUFFIX

    # --- the interface ------------------------------------------------------------------
    def put(self, key: str, value: bytes | bytearray | memoryview) -> None:
        if self.read_only:
            raise ChunkStoreError("a disk-tier prober cannot write")
        size = len(value)
        name = self._name(key)
        if size > self.capacity_bytes:
            with self._lock:
                self._counters["refused"] += 1
            return
        path = self._path(name)
        tmp = path.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as handle:
                handle.write(value)
                if self.fsync:
                    handle.flush()
                    os.fsync(handle.fileno())
            with self._lock:
                self._evict_to(self.capacity_bytes - size, keep=name)
                os.replace(tmp, path)
                self._used += size - self._index.pop(name, 0)
                self._index[name] = size
                self._counters["puts"] += 1
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            with self._lock:
                self._counters["errors"] += 1
            raise ChunkStoreError(f"disk tier: cannot write {path}: {exc}") from exc

    def get(self, key: str) -> bytearray | None:
        name = self._name(key)
        path = self._path(name)
        with self._lock:
            self._counters["gets"] += 1
            if name in self._index:
                self._index.move_to_end(name)
        try:
            with open(path, "rb", buffering=0) as handle:
                size = os.fstat(handle.fileno()).st_size
                data = bytearray(size)  # writable, so the worker views it without a copy
                read = handle.readinto(data)
        except FileNotFoundError:
            with self._lock:  # evicted by us, or deleted behind our back
                if self._index.pop(name, None) is not None:
                    self._used = sum(self._index.values())
            return None
        except OSError as exc:
            with self._lock:
                self._counters["errors"] += 1
            raise ChunkStoreError(f"disk tier: cannot read {path}: {exc}") from exc
        with self._lock:
            self._counters["hits"] += 1
        return data if read == size else data[:read]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [self._path(self._name(key)).is_file() for key in keys]

    def delete(self, key: str) -> None:
        name = self._name(key)
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._used -= size
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(name))

    def _evict_to(self, limit: int, keep: str | None = None) -> None:
        """Delete the oldest chunks until at most `limit` bytes are used (lock held)."""
        while self._used > max(0, limit) and self._index:
            name, size = next(iter(self._index.items()))
            if name == keep:
                self._index.move_to_end(name)
                if len(self._index) == 1:
                    return
                continue
            del self._index[name]
            self._used -= size
            self._counters["evictions"] += 1
            self.evicted.append(name.removesuffix(_SUFFIX))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(name))

    def drain_evicted(self) -> list[str]:
        """File-safe names of the chunks evicted since the last call (for tier events)."""
        with self._lock:
            evicted, self.evicted = self.evicted, []
        return evicted

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"bytes_used": self._used, "num_chunks": len(self._index),
                    "capacity_bytes": self.capacity_bytes, **self._counters}
