"""The managed redis-server: it starts on a free port, answers, reports why it failed to
start, and leaves no process behind, not even when its parent is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.launch import redis_server as redis_server_module
from tandem.launch.redis_server import RedisServer, RedisServerError, find_redis_server


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.usefixtures("redis_binary")
def test_start_ping_stop_leaves_no_process() -> None:
    assert find_redis_server() is not None
    server = RedisServer(maxmemory_bytes=64 << 20).start()
    pid, log_dir = server.pid, server.log_path.parent
    assert pid is not None and alive(pid)
    assert server.url == f"redis://127.0.0.1:{server.port}"
    assert server.ping()
    server.stop()
    assert not alive(pid) and not server.ping() and server.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped, not a zombie
    assert not log_dir.exists()  # its temporary directory is gone too
    server.stop()  # twice is fine


@pytest.mark.usefixtures("redis_binary")
def test_context_manager_and_two_servers_on_their_own_ports(tmp_path: Path) -> None:
    data, log = tmp_path / "data", tmp_path / "logs" / "redis.log"
    with RedisServer(data_dir=data) as one, RedisServer(log_path=log) as two:
        assert one.port != two.port and one.ping() and two.ping()
        assert one.log_path == data / "redis-server.log" and two.log_path == log
        assert "Ready to accept connections" in log.read_text()
        pids = [one.pid, two.pid]
    assert not any(alive(pid) for pid in pids if pid is not None)
    assert list(data.iterdir()) == [data / "redis-server.log"]  # nothing persisted
    assert log.exists()  # a log the caller named stays


@pytest.mark.usefixtures("redis_binary")
def test_a_failed_start_says_why() -> None:
    with RedisServer() as server, pytest.raises(RedisServerError, match="in use"):
        RedisServer(port=server.port).start(timeout=5)  # the port is taken
    with pytest.raises(RedisServerError, match="maxmemory-policy"):
        RedisServer(policy="no-such-policy").start(timeout=5)


def test_a_missing_binary_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_server_module, "_BINARIES", ("no-such-redis-server",))
    assert find_redis_server() is None
    with pytest.raises(FileNotFoundError, match="scripts/setup.sh"):
        RedisServer().start()


_CHILD = """
import sys, time
from tandem.launch.redis_server import RedisServer
server = RedisServer(data_dir=sys.argv[1]).start()  # a killed parent cannot clean up a tmp dir
print(server.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.usefixtures("redis_binary")
def test_the_server_dies_with_a_parent_killed_by_sigkill(tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert alive(pid)
        parent.send_signal(signal.SIGKILL)  # no finalizer, no stop(): only PDEATHSIG
        parent.wait()
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(pid)
    finally:
        parent.kill()
        parent.wait()
