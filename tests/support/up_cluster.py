"""A live `tandem up` for tests (`tests.support.up_cluster`): started as a user starts it, until
its router is healthy and its banner printed; the caller stops it with SIGINT.

A module of its own, like live_server.py, so several test files can start clusters.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tandem.loader.resolve import default_cache_dir
from tandem.platform.cpu_modes import DEFAULT_MODE_ENV
from tandem.platform.ports import free_port
from tandem.trust.keys import CLUSTER_SECRET_ENV
from tandem.trust.peer import peer_client

_START_TIMEOUT = 240.0
# The agent model the harness tests (OpenCode, Claude Code, Codex) run: a tools-aware template.
AGENT_MODEL = "qwen2.5-coder-0.5b"
AGENT_GGUF = default_cache_dir() / "models" / f"{AGENT_MODEL}.gguf"
# The agent cluster's cut-off for a turn whose request names none (Codex sends no
# max_output_tokens): tests/launch/conftest.py passes it as the server's default.
AGENT_OUTPUT_CAP = 1024


@dataclass
class Up:
    """A running `tandem up`: its router URL, its printed banner and its output files."""

    process: subprocess.Popen[bytes]
    url: str
    stdout: Path
    stderr: Path
    banner: str
    log_dir: Path
    secret: str  # the cluster secret the test gave it: workers answer only requests signed with it

    def worker(self, url: str, timeout: float = 10) -> httpx.Client:
        """A client for one of its workers, signing as the router does."""
        return peer_client(self.secret, base_url=url, timeout=timeout)

    def load(self, url: str) -> dict:
        """A worker's GET /load (signed)."""
        with self.worker(url) as client:
            return client.get("/load").json()

    def endpoints(self) -> dict[str, str]:
        """name -> URL of every process the banner lists ("  decode-0  http://...  log: ...")."""
        rows = re.findall(r"^  (\S+)\s+(http://\S+)\s+log: ", self.banner, re.MULTILINE)
        return dict(rows)


def start_up(tmp_path: Path, *argv: str, timeout: float = _START_TIMEOUT, default_mode: bool = False) -> Up:
    """`tandem up *argv` on a free port, logs and ledger under `tmp_path`. `default_mode`: the
    CPU's fast default, not the exact fp32 that tests/conftest.py makes `auto` mean."""
    port = free_port()
    stdout, stderr = tmp_path / "up.stdout", tmp_path / "up.stderr"
    log_dir = tmp_path / "logs"
    command = [sys.executable, "-m", "tandem", "up", "--port", str(port), "--log-dir", str(log_dir),
               "--ledger", str(tmp_path / "usage.sqlite3"), *argv]
    secret = f"up-test-{uuid.uuid4().hex}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{CLUSTER_SECRET_ENV: secret})
    if default_mode:
        env.pop(DEFAULT_MODE_ENV, None)
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"tandem up exited with {process.returncode}:\n{stderr.read_text()}")
        printed = stdout.read_text()
        if "Ctrl-C stops the cluster." in printed:
            assert httpx.get(f"{url}/health", timeout=2).status_code == 200  # printed once healthy
            return Up(process, url, stdout, stderr, printed, log_dir, secret)
        time.sleep(0.25)
    process.kill()
    pytest.fail(f"no banner from tandem up:\n{stderr.read_text()}")


# The router's line for each request it sent prefill then decode (router/http/bookkeeping.py).
_PD_LINE = re.compile(
    r"(?P<kind>\S+) (?P<mode>stream|whole) route=pd \((?P<reason>[^)]*)\) prefill=(?P<prefill>\S+) "
    r"decode=(?P<decode>\S+) .* status=(?P<status>\d+) placement=(?P<placement>.*)$", re.MULTILINE)


@dataclass(frozen=True)
class Routed:
    """One request the router sent prefill then decode, as its log line tells it."""

    mode: str  # "stream" or "whole"
    prefill: str  # the workers' URLs
    decode: str  # "-" where the answer was done at prefill (its first token ended it)
    status: int
    placement: str  # which rule chose each hop, e.g. "prefill:session,decode:session"
    reason: str = ""  # why the router chose PD, or "done at prefill"

    @property
    def decoded(self) -> bool:
        """Whether a decode worker took part: an answer whose first token ends it (a stop
        token, or one token asked for) is done at the prefill worker."""
        return self.decode != "-"


class RouterLog:
    """A cluster's router log from a mark on: what it routed while one test ran, when several
    tests share the cluster."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def mark(self) -> None:
        """From now on: lines written before this call are not the caller's."""
        self._offset = self.path.stat().st_size if self.path.exists() else 0

    def text(self) -> str:
        with self.path.open("rb") as log:
            log.seek(self._offset)
            return log.read().decode(errors="replace")

    def pd_routes(self) -> list[Routed]:
        return [Routed(m["mode"], m["prefill"], m["decode"], int(m["status"]), m["placement"], m["reason"])
                for m in _PD_LINE.finditer(self.text())]
