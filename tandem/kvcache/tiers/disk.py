"""The local-disk KV tier: one file per chunk under a byte budget, least recently used evicted.

Why one file per chunk rather than a preallocated slab: the file system already is an
allocator, a rename is an atomic commit, and a restart finds every committed chunk again by
listing the directory. Layout: `<root>/<shard>/<name>.kv`, where `name` is the key with every
byte outside [A-Za-z0-9-] escaped as `_xx` (reversible, so two keys never share a file and a
restart recovers the keys), and `shard` is two hex digits of a hash of the key, so no
directory holds more than 1/256 of the chunks whatever the keys look like (a shard of
`key[:2]` would put every `tandem:kv:...` key in one directory).

The store owns its directory, and touches nothing else. It deletes files (a stale temporary
file at start-up, a chunk over the budget) and tandem often runs as root, so a directory
given by mistake (`/`, a home, a scratch directory shared with other programs) must not lose
a single file, and a file dropped into the tier's directory by someone else must never be
read, indexed or deleted. Ownership is a marker, `<root>/.tandem-kv-tier.json` holding
`{"owner": "tandem-kv-tier", "format": 1}`, written atomically (temporary file, then rename).
At construction the path must be new (created, parents too, then marked), an empty directory
(marked: claimed), or a directory holding our marker with a format this code knows (used).
Anything else is refused with one `ChunkStoreError` naming the path: a non-empty directory
without the marker, a marker of another owner or format, an unreadable marker, a path that
is not a directory. (A symbolic link at the root itself is followed: where it points is the
operator's choice; none is followed below it.) Within an owned directory only names this
store makes count: shard directories named by exactly two lowercase hex digits (real
directories, never symbolic links), `*.kv` regular files whose name decodes to a valid key
(by default a key `chunk_key` makes, tiers/chunk.py) of that shard, and `.tmp-` followed by
32 lowercase hex digits (what a put writes; deleted only when this user owns it). Every other
entry is left alone and not indexed.
Shard directories and chunk files are opened with O_NOFOLLOW, relative to the shard's own
descriptor, so a symbolic link planted in the tree is never read, written or deleted through.

A put writes `.tmp-<uuid>` in the chunk's directory and renames it over the final name
(`os.replace`, atomic on POSIX): a crash leaves a temporary file, never half a chunk under a
real name. No fsync by default: the tier is a cache, every value carries its own checksum
(chunk.py), and losing the page cache in a power cut costs recomputes, while an fsync per
10 MiB chunk costs the writer thread more than the tier saves. `fsync=True` syncs the file
before the rename and the directory after it.

The budget (`capacity_bytes`) is kept in memory: an LRU of key -> size, touched by puts and
hits. A put that would exceed it first deletes the least recently used files; a value larger
than the whole budget is refused (not stored, counted as `refused`; a put returns normally).
On construction the directory is scanned: our temporary files older than a minute (left by a
crash; younger ones may belong to another process writing now) are deleted, and our `*.kv`
files are indexed oldest modification time first, so chunks survive a restart and the budget
is enforced again if it shrank. Reads do not touch modification times, so after a restart the
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
no eviction, never a write) for a process that only checks existence; until the directory
holds our marker (the writer, in another process, may claim it later) it is empty to the
prober, which then reads nothing in it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import stat
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from tandem.kvcache.tiers.chunk import is_chunk_key
from tandem.kvcache.tiers.store import ChunkStore, ChunkStoreError

MARKER = ".tandem-kv-tier.json"  # in the root of every directory the tier owns
MARKER_OWNER = "tandem-kv-tier"
MARKER_FORMAT = 1  # the layout described above
_MARKER_TMP = re.compile(re.escape(MARKER) + r"\.tmp-[0-9a-f]{32}")  # a claim in progress
_MAX_MARKER = 4096  # bytes read from a marker
_SUFFIX = ".kv"
_TMP_PREFIX = ".tmp-"
_TMP = re.compile(re.escape(_TMP_PREFIX) + r"[0-9a-f]{32}")  # what put writes: uuid4().hex
_SHARD = re.compile(r"[0-9a-f]{2}")  # what shard_of returns
_STALE_TMP_S = 60.0  # a temporary file older than this at start-up was left by a crash
_MAX_EVICTED = 65536  # evicted keys kept for drain_evicted() when nobody drains them
_MAX_NAME = 240  # bytes; file systems allow 255
_SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
_ALL_SAFE = re.compile(r"[A-Za-z0-9-]+")  # chunk keys (chunk.py) are: their name is the key
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW
_FIX = "give --kv-offload-disk-path an empty or new directory"


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


def read_marker(root: str | Path) -> str | None:
    """None when `root` holds no marker, "" when it holds ours, else why it is not ours."""
    try:
        fd = os.open(os.path.join(root, MARKER), os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return "a symbolic link" if exc.errno == errno.ELOOP else f"unreadable ({exc.strerror})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "not a regular file"
        data = os.read(fd, _MAX_MARKER)
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    finally:
        os.close(fd)
    try:
        doc = json.loads(data)
    except ValueError:
        return "not a tandem KV tier marker (not JSON)"
    if not isinstance(doc, dict) or doc.get("owner") != MARKER_OWNER:
        return "not a tandem KV tier marker"
    if doc.get("format") != MARKER_FORMAT:
        return f"of format {doc.get('format')!r}, and this tandem knows format {MARKER_FORMAT} only"
    return ""


def check_claimable(root: Path) -> bool:
    """Raise ChunkStoreError unless `root` is one the tier may own: ours already (its marker),
    empty, or not there yet; whether it exists. Writes nothing, so `tandem serve` checks its
    --kv-offload-disk-path this way before it loads a model."""
    try:
        info = os.stat(root)  # the root itself may be a symbolic link (the operator's)
    except FileNotFoundError:
        if os.path.islink(root):
            raise ChunkStoreError(f"disk tier: {root} is a symbolic link to nothing; {_FIX}") from None
        return False
    if not stat.S_ISDIR(info.st_mode):
        raise ChunkStoreError(f"disk tier: {root} exists and is not a directory; {_FIX}")
    problem = read_marker(root)
    if problem is not None and problem != "":
        raise ChunkStoreError(f"disk tier: {root} has a {MARKER} marker that is {problem}; "
                              f"{_FIX} (or remove the marker if the directory holds nothing "
                              "else worth keeping)")
    # Another process (a second rank on the same path) may be claiming it right now.
    if problem is None and any(name != MARKER and not _MARKER_TMP.fullmatch(name) for name in os.listdir(root)):
        raise ChunkStoreError(f"disk tier: {root} is not empty and was not created by tandem "
                              f"(no {MARKER} marker); {_FIX}")
    return True


class DiskStore(ChunkStore):
    medium = "disk"

    def __init__(self, path: str | Path, capacity_bytes: int, fsync: bool = False,
                 read_only: bool = False, valid_key: Callable[[str], bool] = is_chunk_key) -> None:
        """`valid_key`: which keys the store writes, reads, and recognises in file names (a
        file whose name decodes to any other key is not its own)."""
        self.root = Path(path)
        self.capacity_bytes = int(capacity_bytes)
        self.fsync = fsync
        self.read_only = read_only
        self.valid_key = valid_key
        self._lock = threading.Lock()  # the index, the counters, and every commit or unlink
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> size, least recent first
        self._used = 0
        self._counters = {"puts": 0, "gets": 0, "hits": 0, "evictions": 0, "refused": 0,
                          "errors": 0}
        self._evicted: list[str] = []  # keys evicted since the last drain_evicted()
        self._owned = False  # the root holds our marker (a prober checks until it does)
        if read_only:
            return
        try:
            self._claim()
            self._scan()
        except OSError as exc:
            raise ChunkStoreError(f"disk tier at {self.root}: {exc}") from exc
        with self._lock:
            self._evict_to(self.capacity_bytes)

    @classmethod
    def prober(cls, path: str | Path, valid_key: Callable[[str], bool] = is_chunk_key) -> DiskStore:
        """A read-only view of a directory another process writes: exists/get, no budget."""
        return cls(path, 0, read_only=True, valid_key=valid_key)

    def path_for(self, key: str) -> Path:
        """Where the chunk under `key` lives."""
        return self.root / shard_of(key) / (file_name(key) + _SUFFIX)

    # --- the interface ------------------------------------------------------------------
    def put(self, key: str, value: bytes | bytearray | memoryview) -> None:
        if self.read_only:
            raise ChunkStoreError(f"disk tier at {self.root} is open read-only")
        if not self.valid_key(key):
            raise ChunkStoreError(f"disk tier: {key!r} is not a key this tier stores")
        view = memoryview(value)
        size = view.nbytes
        if size > self.capacity_bytes:
            with self._lock:
                self._counters["refused"] += 1
            return
        path = self.path_for(key)
        name = path.name
        tmp = f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        dir_fd = None
        try:
            dir_fd = self._shard_fd(path.parent.name, create=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666, dir_fd=dir_fd)
            with open(fd, "wb") as handle:
                handle.write(view.cast("B") if view.format != "B" else view)
                if self.fsync:
                    handle.flush()
                    os.fsync(handle.fileno())
            with self._lock:
                self._evict_to(self.capacity_bytes - size, keep=key)
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                self._used += size - self._index.pop(key, 0)
                self._index[key] = size
                self._counters["puts"] += 1
            if self.fsync:
                os.fsync(dir_fd)
        except OSError as exc:
            if dir_fd is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
            with self._lock:
                self._counters["errors"] += 1
            raise ChunkStoreError(f"disk tier: cannot write {path}: {exc}") from exc
        finally:
            if dir_fd is not None:
                os.close(dir_fd)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            self._counters["gets"] += 1
        if not self.valid_key(key) or not self._is_owned():
            return None  # never a file this store could have written
        path = self.path_for(key)
        try:
            dir_fd = self._shard_fd(path.parent.name)
            try:
                fd = os.open(path.name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
            with open(fd, "rb", buffering=0) as handle:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(errno.EINVAL, "not a regular file")
                data = handle.read()  # the whole file; faster than readinto (module docstring)
        except FileNotFoundError:
            with self._lock:  # evicted, or deleted behind our back: forget it
                if key in self._index and not os.path.lexists(path):  # (a put may have just landed)
                    self._used -= self._index.pop(key)
            return None
        except OSError as exc:
            with self._lock:
                self._counters["errors"] += 1
            if exc.errno == errno.ELOOP:  # a symbolic link: not a file this store wrote
                raise ChunkStoreError(f"disk tier: not reading {path} or its directory: "
                                      "a symbolic link, not written by the tier") from exc
            raise ChunkStoreError(f"disk tier: cannot read {path}: {exc}") from exc
        with self._lock:
            self._counters["hits"] += 1
            if key in self._index:
                self._index.move_to_end(key)
        return data

    def exists(self, keys: Sequence[str]) -> list[bool]:
        # The file system, not the index: another process may have written or deleted it.
        if not self._is_owned():
            return [False] * len(keys)
        return [self._has_file(key) for key in keys]

    def delete(self, key: str) -> None:
        if self.read_only:
            raise ChunkStoreError(f"disk tier at {self.root} is open read-only")
        if not self.valid_key(key):
            return  # no file of ours has that name
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
            try:
                self._unlink(key)
            except OSError as exc:
                self._counters["errors"] += 1
                raise ChunkStoreError(f"disk tier: cannot delete {self.path_for(key)}: {exc}") from exc

    def drain_evicted(self) -> list[str]:
        """Keys the budget evicted since the last call (for the tiers' removal events)."""
        with self._lock:
            evicted, self._evicted = self._evicted, []
        return evicted

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"bytes_used": self._used, "num_chunks": len(self._index),
                    "capacity_bytes": self.capacity_bytes, **self._counters}

    # --- ownership ----------------------------------------------------------------------
    def _claim(self) -> None:
        """Create or claim the root, or raise ChunkStoreError (module docstring's rules)."""
        root = self.root
        if not check_claimable(root):
            root.mkdir(parents=True, exist_ok=True)
            check_claimable(root)
        if read_marker(root) != "":
            self._write_marker()
        self._owned = True

    def _write_marker(self) -> None:
        tmp = self.root / f"{MARKER}.tmp-{uuid.uuid4().hex}"
        body = json.dumps({"owner": MARKER_OWNER, "format": MARKER_FORMAT}).encode() + b"\n"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
        try:
            with open(fd, "wb") as handle:
                handle.write(body)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.root / MARKER)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _is_owned(self) -> bool:
        if not self._owned:  # a prober: the writer may have claimed the directory since
            self._owned = read_marker(self.root) == ""
        return self._owned

    # --- internals ----------------------------------------------------------------------
    def _shard_fd(self, shard: str, create: bool = False) -> int:
        """A descriptor of the shard directory, never through a symbolic link."""
        path = os.path.join(self.root, shard)
        try:
            return os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            if not create:
                raise
        except NotADirectoryError:  # Linux says so of a link opened with O_NOFOLLOW too
            if os.path.islink(path):
                raise OSError(errno.ELOOP, "a symbolic link", path) from None
            raise
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)
        return os.open(path, _DIR_FLAGS)

    def _has_file(self, key: str) -> bool:
        if not self.valid_key(key):
            return False
        path = self.path_for(key)
        try:
            return (stat.S_ISDIR(os.lstat(path.parent).st_mode)
                    and stat.S_ISREG(os.lstat(path).st_mode))
        except OSError:
            return False

    def _unlink(self, key: str) -> None:
        """Delete the chunk file of `key`; absent, or not a regular file (a link, a directory
        someone put at its name): a no-op. Never through a symbolic link."""
        path = self.path_for(key)
        try:
            dir_fd = self._shard_fd(path.parent.name)
        except FileNotFoundError:
            return
        try:
            if stat.S_ISREG(os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                os.unlink(path.name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        finally:
            os.close(dir_fd)

    def _scan(self) -> None:
        """Index our committed chunks, oldest first; delete our temporary files left by a
        crash. Every other entry is left alone (module docstring)."""
        found: list[tuple[float, str, int]] = []
        stale_before = time.time() - _STALE_TMP_S
        with os.scandir(self.root) as entries:
            shards = [entry.name for entry in entries
                      if _SHARD.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)]
        for shard in shards:
            try:
                dir_fd = self._shard_fd(shard)
            except OSError:
                continue  # replaced since (by a link, a file): not ours
            try:
                with os.scandir(dir_fd) as entries:
                    for entry in entries:
                        with contextlib.suppress(FileNotFoundError):  # gone meanwhile
                            self._scan_entry(entry, shard, dir_fd, stale_before, found)
            finally:
                os.close(dir_fd)
        for _, key, size in sorted(found):
            self._index[key] = size
            self._used += size

    def _scan_entry(self, entry: os.DirEntry, shard: str, dir_fd: int, stale_before: float,
                    found: list[tuple[float, str, int]]) -> None:
        name = entry.name
        if _TMP.fullmatch(name):
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if (stat.S_ISREG(info.st_mode) and info.st_mtime < stale_before
                        and info.st_uid == os.geteuid()):  # another user's is not ours
                    os.unlink(name, dir_fd=dir_fd)
            return
        if not name.endswith(_SUFFIX):
            return
        key = key_of(name[:-len(_SUFFIX)])
        if key is None or not self.valid_key(key) or shard_of(key) != shard:
            return  # not a file this store wrote: leave it alone
        info = entry.stat(follow_symlinks=False)
        if stat.S_ISREG(info.st_mode):
            found.append((info.st_mtime, key, info.st_size))

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
                self._unlink(key)
            except OSError:  # out of the budget all the same; the next scan retries
                self._counters["errors"] += 1
        del self._evicted[:-_MAX_EVICTED]
