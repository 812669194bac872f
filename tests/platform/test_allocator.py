"""glibc's thresholds set by tandem/platform/allocator.py, read back through `mallinfo2`: an
activation-sized buffer (16 MiB) comes from the heap instead of a mapping of its own, and
the heap keeps it once freed, so the next step's buffer reuses mapped pages. Each case runs in
a fresh interpreter (the settings are per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = """
import ctypes, json, sys, torch
from tandem.platform.allocator import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
before = libc.mallinfo2()
buffer = torch.ones(4 << 20)  # 16 MiB
held = libc.mallinfo2()
del buffer
freed = libc.mallinfo2()
print(json.dumps({"kept": kept, "mapped": held.hblkhd - before.hblkhd, "heap_held": held.arena,
                  "heap_freed": freed.arena}))
"""
MIB = 1 << 20


def _probe(mode: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True,
                          env={**os.environ, **(env or {})})
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_buffer_comes_from_the_heap_and_stays_there_once_freed() -> None:
    plain = _probe("plain")
    assert plain["mapped"] >= 16 * MIB  # glibc as it comes: a mapping of its own, unmapped on free
    kept = _probe("keep")
    assert kept["kept"] is True
    assert kept["mapped"] < MIB  # from the heap
    assert kept["heap_freed"] >= kept["heap_held"]  # not trimmed on free: the next allocation reuses it


def test_the_users_own_malloc_tunables_stand() -> None:
    assert _probe("keep", {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=4096"})["kept"] is False
