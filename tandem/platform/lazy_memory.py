"""Zeroed tensors that cost nothing until written: a KV cache's memory.

A KV budget may be gigabytes, so the target's cache and a draft model's are anonymous (or
/dev/shm) mappings whose pages the OS zeroes on first write. The worker then commits the
target's cache whole at start (`platform/pages.py`; `--lazy-kv-cache` leaves it lazy).
"""

from __future__ import annotations

import math
import mmap
import os

import torch


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor backed by an anonymous mmap: the OS hands out zero pages on first write.

    The KV budget may be gigabytes; zero-filling it from user space would cost seconds at
    start-up (committing the zero pages in the kernel, `pages.commit_for_write`, takes ~0.4 s a
    GiB). Uninitialised memory would be free but may hold any bit pattern, and a
    padded attention read multiplies slots past a sequence's end by zero probability, which
    a NaN survives. Fresh anonymous pages are both free and zero. The tensor keeps the
    mapping alive.

    Private, not Python's default shared mapping: a shared anonymous page is a shmem page,
    and its first write (a KV block's first use, inside a timed step) cost 2.7-4.2 us against
    a private page's 1.9-2.2 us (the 2-core AVX-512 EPYC VM, 512 MiB touched page by page).
    Nothing maps this memory from another process (`shared_zeroed` is the cache that is).
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(mapping, dtype=dtype, count=math.prod(shape)).view(shape)


def shared_zeroed(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Like `lazily_zeroed`, but in a file (under /dev/shm) that other processes can map.

    A decode worker on the same host reads a prefill worker's KV blocks straight from this
    mapping instead of over a socket. A sparse file reads as zeros and commits pages on first
    write, so the lazy-zero property holds.
    """
    nbytes = max(math.prod(shape) * torch.empty((), dtype=dtype).element_size(), 1)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=dtype, count=math.prod(shape)).view(shape)
