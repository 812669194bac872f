"""Waiting for processes to end, where "ended" includes a zombie nobody has reaped yet.

A server's multiprocessing resource tracker outlives the server by a moment and is then an
orphan: its exit is reaped by PID 1, which in a container may do so only every second or two.
psutil counts an unreaped zombie as alive, so waiting on it cost ~1.7 s per stopped server on
the CI-like VM; a zombie has run its last instruction and holds no port, file or memory.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import psutil


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_ended(processes: Iterable[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to `timeout` s for every process to exit; returns those still running."""
    left = list(processes)
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in left if _running(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)
