"""A local redis-server (or valkey-server) as a child process: the cluster KV tier's store for
a single machine, and a real server for tests.

Why a managed child rather than "bring your own": a KV cache wants a particular server (no
persistence, a memory cap, LRU eviction), and a server left running after the engine is gone
holds gigabytes for nothing. So it runs with `--save '' --appendonly no` (a restart starts
empty instead of replaying gigabytes), `--maxmemory N --maxmemory-policy allkeys-lru` (old
chunks make room for new ones; writes never fail for memory), and it never outlives us:
`stop()`, a finalizer at interpreter exit, and on Linux PR_SET_PDEATHSIG, so even a parent
killed with SIGKILL takes the server down. PR_SET_PDEATHSIG fires when the *thread* that
started the child exits, so it is only set when `start()` runs on the main thread.

The server's working directory is `data_dir` (a temporary directory when none is given,
removed by `stop()`); its stdout and stderr go to `log_path` (appended to), by default
`redis-server.log` in that directory. A server that fails to start raises RedisServerError
with what it logged.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

from tandem.launch.supervisor import die_with_parent_hook, stop_process
from tandem.platform.ports import free_port

_BINARIES = ("redis-server", "valkey-server")
_SYSTEM_DIRS = ("/usr/bin", "/usr/sbin", "/usr/local/bin")
_PR_SET_PDEATHSIG = 1
_INSTALL_HINT = ("run scripts/setup.sh (it installs redis-server) or "
                 "`apt-get install redis-server`")


class RedisServerError(RuntimeError):
    """The server could not be started (the message has the end of its log)."""


def find_redis_server() -> str | None:
    """The path of redis-server, else valkey-server (PATH first, then the system's bin
    directories, which a virtual environment's PATH may lack), or None."""
    for name in _BINARIES:
        found = shutil.which(name)
        if found:
            return found
        for directory in _SYSTEM_DIRS:
            candidate = Path(directory) / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def _read_replies(sock: socket.socket, count: int) -> bytes:
    """`count` one-line replies (+OK, +PONG, -ERR ...), concatenated."""
    data = b""
    while data.count(b"\r\n") < count:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


class RedisServer:
    """One server process. `start()` it (or use `with`), read `url`, `stop()` it. The server
    is also stopped when this object is garbage-collected or the interpreter exits, so keep
    the object for as long as the server should run."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1",
                 maxmemory_bytes: int | None = None, policy: str = "allkeys-lru",
                 data_dir: str | Path | None = None, log_path: str | Path | None = None,
                 password: str | None = None) -> None:
        self.host = host
        # Clients must AUTH with it (tandem up: the cluster secret). It goes to the server in
        # a 0600 config file, not on its command line, where `ps` would show it.
        self.password = password
        self.port = port
        self.maxmemory_bytes = maxmemory_bytes
        self.policy = policy
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self._log_path = Path(log_path) if log_path is not None else None
        self._log_start = 0  # where this start's output begins in the log
        self.process: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RedisServerError("the server has no port until start()")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"redis://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def log_path(self) -> Path | None:
        if self._log_path is not None:
            return self._log_path
        directory = self.data_dir or (Path(self._tmp.name) if self._tmp else None)
        return directory / "redis-server.log" if directory else None

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers (itself, not another server that holds
        the port); returns self. Raises RedisServerError with the server's log otherwise."""
        if self.process is not None and self.process.poll() is None:
            return self
        binary = find_redis_server()
        if binary is None:
            raise FileNotFoundError(f"no redis-server or valkey-server found: {_INSTALL_HINT}")
        if self.data_dir is None and self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tandem-redis-")
        directory = self.data_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        directory.mkdir(parents=True, exist_ok=True)
        pick_port = self.port is None
        for attempt in range(3):  # a free port found by bind() may be taken before the server
            if pick_port:
                self.port = free_port(self.host)
            try:
                self._launch(binary, directory, timeout)
                return self
            except RedisServerError:
                if not pick_port or attempt == 2 or "in use" not in self._log_tail():
                    self.stop()
                    raise
        raise AssertionError("unreachable")

    def _launch(self, binary: str, directory: Path, timeout: float) -> None:
        argv = [binary]
        if self.password is not None:
            config = directory / "auth.conf"
            config.touch(mode=0o600)
            config.chmod(0o600)
            quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
            config.write_text(f'requirepass "{quoted}"\n')
            argv.append(str(config))
        argv += ["--port", str(self.port), "--bind", self.host, "--protected-mode", "no",
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", str(directory),
                "--maxmemory-policy", self.policy]
        if self.maxmemory_bytes is not None:
            argv += ["--maxmemory", str(int(self.maxmemory_bytes))]
        log_path = self.log_path
        assert log_path is not None
        if self._finalizer is not None:  # an earlier attempt's process, already gone
            self._finalizer.detach()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self._log_start = log.tell()
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, cwd=directory,
                                       preexec_fn=die_with_parent_hook())
        self.process = process
        self._finalizer = weakref.finalize(self, stop_process, process, 5.0)
        deadline = time.monotonic() + timeout
        while self._answering_pid() != process.pid:  # not just any server on this port
            if process.poll() is not None:
                raise RedisServerError(f"{binary} exited with code {process.returncode} on "
                                       f"start ({' '.join(argv)}):\n{self._log_tail()}")
            if time.monotonic() > deadline:
                tail = self._log_tail()
                self.stop()
                raise RedisServerError(f"{binary} did not answer PING on {self.url} within "
                                       f"{timeout:g} s:\n{tail}")
            time.sleep(0.02)

    def ping(self, timeout: float = 0.5) -> bool:
        """Whether the server answers PING (a plain socket: no client library, no retries)."""
        if self.port is None:
            return False
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout) as sock:
                sock.sendall(self._auth() + b"PING\r\n")
                if self.password is not None:
                    return b"+PONG" in _read_replies(sock, 2)
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def _answering_pid(self, timeout: float = 0.5) -> int | None:
        """The process id of the server answering on our port (INFO server), or None."""
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout) as sock:
                sock.sendall(self._auth())
                if self.password is not None and not _read_replies(sock, 1).startswith(b"+OK"):
                    return None
                sock.sendall(b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n")
                reply = b""
                while True:  # a bulk string: $<length>\r\n<body>\r\n
                    data = sock.recv(65536)
                    if not data:
                        break
                    reply += data
                    head, sep, _ = reply.partition(b"\r\n")
                    if sep and (not head.startswith(b"$") or
                                len(reply) >= len(head) + 4 + int(head[1:])):
                        break
        except (OSError, ValueError):
            return None
        for line in reply.split(b"\r\n"):
            if line.startswith(b"process_id:"):
                return int(line.split(b":", 1)[1])
        return None

    def _auth(self) -> bytes:
        """The AUTH command to send first, as a RESP array (nothing without a password)."""
        if self.password is None:
            return b""
        secret = self.password.encode()
        return b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(secret), secret)

    def _log_tail(self, max_bytes: int = 4000) -> str:
        """The end of what the server logged since the last launch."""
        path = self.log_path
        if path is None or not path.exists():
            return ""
        with open(path, "rb") as log:
            log.seek(max(self._log_start, log.seek(0, os.SEEK_END) - max_bytes))
            return log.read().decode(errors="replace")

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`; waits for the process (no zombie) and removes
        the temporary directory. Stopping a stopped server does nothing."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        process, self.process = self.process, None
        if process is not None:
            stop_process(process, timeout)
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
