"""`tandem keys add|list|revoke` as a user runs it: the key printed once, only hashes stored."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tandem.router.accounting.auth import read_api_keys
from tandem.router.accounting.keys_store import read_store


def _keys(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tandem", "keys", *argv], capture_output=True,
                          text=True, timeout=120)


def test_add_list_revoke(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    added = _keys("add", "alice", "--rpm", "60", "--file", str(path))
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip().splitlines()[-1]
    assert key.startswith("sk-tandem-") and key not in path.read_text()
    assert read_api_keys(path).authenticate(f"Bearer {key}").limits.rpm == 60
    listed = _keys("list", "--file", str(path))
    assert "alice" in listed.stdout and "rpm=60" in listed.stdout and key not in listed.stdout
    assert _keys("revoke", "alice", "--file", str(path)).returncode == 0
    assert read_store(path)[0].revoked
    missing = _keys("revoke", "bob", "--file", str(path))
    assert missing.returncode == 2 and "no live key" in missing.stderr
    bad = _keys("add", "carol", "--rpm", "0", "--file", str(path))
    assert bad.returncode == 2 and "positive integer" in bad.stderr
