"""A local `mooncake_master` as a child process, for `tandem up --kv-store mooncake` and for
tests: started on a free port, stopped with its parent.

The master is the native binary shipped inside the `mooncake` Python package (the
`mooncake_master` console script only execs it). It holds metadata, not data: the bytes live in
the segments the clients contribute (mooncake_store.py), so it needs no memory cap, and a
restarted master starts empty. Its RPC and admin/metrics servers bind to `host` (they bind
0.0.0.0 unless told otherwise), the admin port is picked by the kernel (`--metrics_port=0`),
and its built-in HTTP metadata server stays off unless asked for: clients find each other by
P2P handshake (`metadata=P2PHANDSHAKE`, the store's default). On Linux it gets SIGTERM if
the process that started it dies, so it never outlives its cluster.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tandem.launch.supervisor import die_with_parent_hook, stop_process
from tandem.platform.ports import free_port

_PR_SET_PDEATHSIG = 1


def find_mooncake_master() -> str | None:
    """The native master binary inside the installed `mooncake` package, or None."""
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "mooncake_master"
        if path.is_file():
            if not os.access(path, os.X_OK):  # wheels have been known to drop the mode bits
                with contextlib.suppress(OSError):
                    path.chmod(path.stat().st_mode | 0o111)
            return str(path)
    return None


def _accepts(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class MooncakeMaster:
    def __init__(self, port: int | None = None, host: str = "127.0.0.1",
                 log_path: str | Path | None = None, http_metadata: bool = False,
                 extra_args: Sequence[str] = ()) -> None:
        self.host = host
        self.port = port
        self.log_path = Path(log_path) if log_path else None
        self.http_metadata = http_metadata
        self.http_port: int | None = None
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen | None = None
        self._log = None  # what the master writes to: log_path, or an unnamed temporary file

    @property
    def url(self) -> str:
        """The --kv-store URL of this master (with its HTTP metadata server when it runs one)."""
        url = f"mooncake://{self.host}:{self.port}"
        return url + f"?metadata={self.metadata_url}" if self.http_metadata else url

    @property
    def metadata_url(self) -> str:
        if not self.http_metadata:
            return "P2PHANDSHAKE"
        return f"http://{self.host}:{self.http_port}/metadata"

    def start(self, timeout: float = 10.0) -> MooncakeMaster:
        binary = find_mooncake_master()
        if binary is None:
            raise FileNotFoundError("no mooncake_master found: install the Mooncake package "
                                    "(`pip install mooncake-transfer-engine-non-cuda`; "
                                    "scripts/setup.sh does)")
        if self.port is None:
            self.port = free_port(self.host)
        argv = [binary, f"--rpc_port={self.port}", f"--rpc_address={self.host}",
                f"--metrics_host={self.host}", "--metrics_port=0",
                "--enable_metric_reporting=false"]
        if self.http_metadata:
            self.http_port = self.http_port or free_port(self.host)
            argv += ["--enable_http_metadata_server=true",
                     f"--http_metadata_server_host={self.host}",
                     f"--http_metadata_server_port={self.http_port}"]
        argv += self.extra_args
        self._close_log()
        if self.log_path:
            self._log = open(self.log_path, "ab+")  # noqa: SIM115 - open while the master runs
        else:
            self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self.process = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent_hook())
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                code, self.process = self.process.returncode, None
                tail = self._log_tail()
                self._close_log()
                raise RuntimeError(f"{binary} exited with code {code} on start" + tail)
            up = _accepts(self.host, self.port) and (
                not self.http_metadata or _accepts(self.host, self.http_port))
            if up and self.process.poll() is None:  # and not someone else on the port
                return self
            if time.monotonic() > deadline:
                tail = self._log_tail()
                self.stop()
                raise TimeoutError(f"{binary} did not accept connections on "
                                   f"{self.host}:{self.port} within {timeout:.0f} s" + tail)
            time.sleep(0.05)

    def _log_tail(self, lines: int = 20, max_bytes: int = 16384) -> str:
        if self._log is None:
            return ""
        try:
            self._log.seek(0, os.SEEK_END)
            self._log.seek(max(0, self._log.tell() - max_bytes))
            tail = self._log.read().decode(errors="replace").splitlines()[-lines:]
        except (OSError, ValueError):
            return ""
        where = f"the end of {self.log_path}" if self.log_path else "its log"
        return f"; {where}:\n" + "\n".join(tail) if tail else ""

    def _close_log(self) -> None:
        log, self._log = self._log, None
        if log is not None:
            log.close()

    def stop(self, timeout: float = 5.0) -> None:
        process, self.process = self.process, None
        try:
            if process is not None:
                stop_process(process, timeout)
        finally:
            self._close_log()

    def __enter__(self) -> MooncakeMaster:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
