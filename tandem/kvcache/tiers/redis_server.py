"""A local redis-server (or valkey-server) as a child process, for `tandem up --kv-store redis`
and for tests: started on a free port with a memory cap and LRU eviction, stopped with its
parent.

The server keeps nothing on disk (`--save ''`, no AOF): the cluster tier is a cache, and a
restart should start empty rather than replay gigabytes. On Linux it gets SIGTERM if the
process that started it dies, so it never outlives its cluster.
"""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis

_SERVERS = ("redis-server", "valkey-server")
_PR_SET_PDEATHSIG = 1


def find_redis_server() -> str | None:
    for name in _SERVERS:
        path = shutil.which(name) or next((str(p) for p in (Path("/usr/bin") / name, Path("/usr/sbin") / name)
                                           if p.is_file()), None)
        if path:
            return path
    return None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class RedisServer:
    def __init__(self, port: int | None = None, host: str = "127.0.0.1", maxmemory_bytes: int | None = None,
                 policy: str = "allkeys-lru", log_path: str | Path | None = None) -> None:
        self.host = host
        self.port = port
        self.maxmemory_bytes = maxmemory_bytes
        self.policy = policy
        self.log_path = Path(log_path) if log_path else None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> RedisServer:
        binary = find_redis_server()
        if binary is None:
            raise FileNotFoundError("no redis-server or valkey-server found: run scripts/setup.sh (it installs "
                                    "redis-server) or `apt-get install redis-server`")
        if self.port is None:
            self.port = _free_port(self.host)
        argv = [binary, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no",
                "--protected-mode", "no", "--maxmemory-policy", self.policy, "--daemonize", "no"]
        if self.maxmemory_bytes:
            argv += ["--maxmemory", str(self.maxmemory_bytes)]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        deadline = time.monotonic() + timeout
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5)
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{binary} exited with code {self.process.returncode} on start"
                                       + (f"; see {self.log_path}" if self.log_path else ""))
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    if client.ping():
                        return self
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"{binary} did not answer PING on {self.url} within {timeout:.0f} s")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, timeout: float = 5.0) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> RedisServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
