"""Live `tandem serve` processes for tests that speak HTTP (`tests.support.live_server`).

A server is started as a user would start it (`python -m tandem serve ...`) on a free
port, waited for through `GET /health`, and stopped with SIGINT (or SIGTERM); stopping
reports any process left behind (the engine core must exit with the server).

A module of its own, not conftest.py: test files import these helpers, and a conftest is
pytest's to import, not theirs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from tandem.platform.ports import free_port
from tandem.trust.keys import CLUSTER_SECRET_ENV
from tandem.trust.peer import peer_client
from tests.support.processes import wait_ended

_START_TIMEOUT = 240.0


# The cluster secret tests give workers that take part in a handoff (tandem/trust): such a
# worker answers only signed requests, so tests that play the router sign with it.
TEST_SECRET = "tandem-tests-cluster-secret"


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    secret: str | None = None  # the worker's cluster secret, if it has one
    token: str | None = None  # a bearer token for its /load and control endpoints (--admin-key / --api-key)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, timeout: float = 120) -> httpx.Client:
        """An HTTP client for this worker: its requests signed as a peer's when it has a secret."""
        headers = {"authorization": f"Bearer {self.token}"} if self.token else None
        return peer_client(self.secret, base_url=self.url, timeout=timeout, headers=headers)

    def post(self, path: str, body: dict, timeout: float = 120) -> httpx.Response:
        with self.client(timeout) as client:
            return client.post(path, json=body)

    def load(self) -> dict:
        with self.client(10) as client:
            return client.get("/load").json()

    def wait_idle(self, timeout: float = 15.0) -> dict:
        """The /load report once no request is in flight and no KV block is held."""
        deadline = time.monotonic() + timeout
        while True:
            load = self.load()
            idle = (load["num_requests_in_flight"] == 0 and load["kv_blocks_used"] == 0
                    and load["num_running_requests"] == 0 and load["num_waiting_requests"] == 0)
            if idle or time.monotonic() > deadline:
                return load
            time.sleep(0.1)


def start_server(log_path: Path, *args: str, env: dict[str, str] | None = None, host: str = "127.0.0.1",
                 wrapper: tuple[str, ...] = (), port: int | None = None, secret: str | None = None,
                 token: str | None = None) -> LiveServer:
    """`wrapper` runs the server through another command, e.g. ("ip", "netns", "exec", NAME)
    to put it on another (virtual) host; `host` is then that host's address (port 8000
    there unless `port` is given). `secret`: the cluster secret, in the server's environment."""
    if port is None:
        port = free_port() if host == "127.0.0.1" else 8000
    level = os.environ.get("TANDEM_TEST_SERVER_LOG_LEVEL", "INFO")
    command = [*wrapper, sys.executable, "-m", "tandem", "--log-level", level, "serve", "--host", host,
               "--port", str(port), "--no-access-log", *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    env.pop(CLUSTER_SECRET_ENV, None)
    if secret is not None:
        env[CLUSTER_SECRET_ENV] = secret
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = LiveServer(f"http://{host}:{port}", process, log_path, secret, token)
    deadline = time.monotonic() + _START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {process.returncode}:\n{server.log()[-3000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop_server(server)
    raise RuntimeError(f"tandem serve not healthy after {_START_TIMEOUT:.0f} s:\n{server.log()[-3000:]}")


def stop_server(server: LiveServer, sig: signal.Signals = signal.SIGINT) -> list[int]:
    """SIGINT (Ctrl-C) or SIGTERM; returns the pids of processes left behind (should be none)."""
    try:
        children = psutil.Process(server.process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    if server.process.poll() is None:
        server.process.send_signal(sig)
        try:
            server.process.wait(30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    alive = wait_ended(children, timeout=15)
    for process in alive:
        process.kill()
    return [p.pid for p in alive]


def start_router(log_path: Path, *args: str, wrapper: tuple[str, ...] = (),
                 secret: str | None = None) -> tuple[str, subprocess.Popen[bytes]]:
    """A `tandem route` process on a free port with `args` (its workers), once healthy; the
    caller terminates it. `wrapper` runs it through another command (as for start_server);
    `secret`: the cluster secret, in its environment."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop(CLUSTER_SECRET_ENV, None)
    if secret is not None:
        env[CLUSTER_SECRET_ENV] = secret
    with log_path.open("wb") as log:
        process = subprocess.Popen([*wrapper, sys.executable, "-m", "tandem", "route", "--port", str(port), *args],
                                   stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url, process
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"tandem route not healthy:\n{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
