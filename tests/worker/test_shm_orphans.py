"""Shared-memory KV caches of workers that died: removed by the next worker that makes one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tandem.worker.worker import remove_orphaned_kv_files


def test_a_dead_workers_kv_file_goes_and_a_live_ones_stays(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    orphan = tmp_path / f"tandem-kv-{dead.stdout.strip()}-0123abcd"
    live = tmp_path / f"tandem-kv-{os.getpid()}-89abcdef"
    foreign = tmp_path / f"tandem-kv-{dead.stdout.strip()}-notours"  # not a name the worker writes
    for path in (orphan, live, foreign):
        path.write_bytes(b"\0" * 16)
    assert remove_orphaned_kv_files(str(tmp_path)) == [str(orphan)]
    assert not orphan.exists() and live.exists() and foreign.exists()
