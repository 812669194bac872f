"""glibc's malloc told to keep large freed blocks in the process, for CPU workers.

A step's activations are freed at its end and allocated again by the next step. glibc serves
a block above its mmap threshold (dynamic, at most 32 MiB) with a fresh mapping and unmaps it
on free, and trims the heap's top once more than its trim threshold is free: either way the
next step's buffers come back as new pages, each one faulted in and zeroed by the kernel. At
2,048-token fp32 prefill steps that was most of the page-fault time perf showed (~4% of a
run). With the thresholds fixed high, freed blocks are reused as a caching allocator would:
`tandem bench offline --exact --workloads prefill-heavy` on the 2-core AVX-512 EPYC, paired,
1,338 / 1,549 and 1,481 / 1,582 prompt tok/s; the default and plain bf16 modes level
(docs/performance.md). The process keeps up to `trim` bytes of freed heap: its resident size
stays near its peak instead of falling back between steps. It is set in the worker's process,
which for `tandem.LLM` is the caller's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3


@dataclass(frozen=True)
class MallocThresholds:
    mmap: int = 32 << 20  # blocks up to this size come from the heap (glibc: at most 32 MiB on 64-bit)
    trim: int = 1 << 30  # free heap kept before the top is handed back


def keep_freed_memory(thresholds: MallocThresholds = MallocThresholds()) -> bool:
    """Set glibc's thresholds in this process; False where it is not glibc (no `mallopt`),
    a call is refused, or the user set malloc tunables of their own (GLIBC_TUNABLES), which
    then stand."""
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, thresholds.mmap)) and bool(mallopt(_M_TRIM_THRESHOLD, thresholds.trim))
