"""Engine flags that cannot work together fail while the command line is read: one line, exit
status 2, before any process starts or any model loads."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

TANDEM = [sys.executable, "-m", "tandem.cli.main"]


def run(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([*TANDEM, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    return result, time.monotonic() - started


@pytest.mark.parametrize(("args", "message"), [
    (("serve", "--device", "cpu", "--async-scheduling", "on", "--world-size", "2", "--port", "1"),
     "--async-scheduling on needs one rank"),
    (("serve", "--device", "cpu", "--tensor-parallel-size", "2", "--kv-offload-cpu-bytes", "1GiB", "--port", "1"),
     "does not yet work with --role prefill/decode or the KV tiers"),
    (("generate", "-p", "hi", "--device", "cpu", "--dtype", "bfloat16", "--decode-weights", "float32"),
     "--decode-weights float32 keeps an fp32 model's own rows"),
])
def test_incompatible_flags_fail_at_once_in_one_line(args: tuple[str, ...], message: str) -> None:
    result, seconds = run(*args)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("tandem: error: ") and message in line and result.stdout == ""
    assert "torch" not in result.stderr and seconds < 60  # no model, no engine process
