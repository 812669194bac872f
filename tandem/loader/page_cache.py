"""A file's pages in the page cache: drop them, count them (Linux; no root needed).

`drop` asks the kernel to evict a file's cached pages (posix_fadvise DONTNEED). It cannot
evict pages some process still maps, nor dirty ones (so it flushes them first), so callers
that need a cold file check with `resident_bytes`, which asks mincore(2) about a fresh
mapping of the file. Since Linux 5.2 mincore reports page-cache residency only to a process
that owns the file or may write to it (to anyone else it reports just its own mapped pages,
which would look like an empty cache): then `resident_bytes` answers None, "cannot tell".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import time
from pathlib import Path

_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        _libc = libc
    return _libc


def drop(path: str | Path) -> None:
    """Evict `path`'s pages from the page cache (flushing dirty ones first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def make_cold(path: str | Path, tries: int = 3) -> int | None:
    """`drop` until nothing of `path` is cached (a page the kernel is still adding to its
    lists can survive one drop); returns the bytes left cached (None: cannot tell)."""
    left = None
    for attempt in range(tries):
        if attempt:
            time.sleep(0.05 * attempt)
        drop(path)
        left = resident_bytes(path)
        if not left:
            return left
    return left


def can_see_cache(path: str | Path) -> bool:
    """Whether mincore tells this process about `path`'s page cache (see the module doc)."""
    return os.geteuid() in (0, os.stat(path).st_uid) or os.access(path, os.W_OK)


def resident_pages(path: str | Path) -> list[bool] | None:
    """Per page of `path`: is it in the page cache? None when this process cannot tell."""
    vector = _mincore(path)
    return None if vector is None else [bool(byte & 1) for byte in vector]


def resident_bytes(path: str | Path) -> int | None:
    """Bytes of `path` in the page cache (whole pages, capped at its size); None: cannot tell."""
    vector = _mincore(path)
    if vector is None:
        return None
    pages = len(vector) - vector.translate(_LOW_BIT).count(0)
    return min(pages * mmap.PAGESIZE, os.path.getsize(path))


_LOW_BIT = bytes(i & 1 for i in range(256))


def _mincore(path: str | Path) -> bytes | None:
    """mincore(2)'s vector for a fresh mapping of `path` (a byte per page, bit 0: cached)."""
    if not hasattr(os, "posix_fadvise") or not can_see_cache(path):
        return None
    size = os.path.getsize(path)
    if size == 0:
        return b""
    libc = _c()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return None
            return vec.raw[:pages]
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)

