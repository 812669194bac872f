"""Child processes started, health-gated and stopped one way, wherever tandem launches them.

`tandem up` (router + workers), `tandem bench serve` (a server, a cluster or a peer per target)
and `tandem bench offline` (one engine run per process) all start other programs and must
never leave one behind. The rules live here, once:

- `start`: the child runs in its own session, so a terminal's Ctrl-C reaches only the
  supervising process, which then stops its children in order; stdout and stderr go to a log
  file. On Linux the child also gets SIGTERM when the thread that started it dies, even by
  SIGKILL (PR_SET_PDEATHSIG), so a killed supervisor leaves no orphans: start children from
  a thread that lives as long as they should (the main thread, in every command).
- `wait_healthy`: poll each child's GET /health until it answers 200; a child that exits
  first, or is still not up at the deadline, is an error that carries the end of its log.
- `stop`: SIGINT (as Ctrl-C would: servers shut down their own children cleanly), wait, then
  SIGKILL; descendants are found before the signal (once a parent has exited its orphans can
  no longer be traced to it) and killed if they outlive the wait, and last whatever is left
  in the child's process group is killed too.

Torch-free: only the standard library, httpx and psutil.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class ProcessSpec:
    """What to run and where its output goes; `url` is the base URL whose GET /health says the
    child is ready (None for a child that is only waited for, not health-gated)."""

    name: str
    argv: tuple[str, ...]
    log_path: Path
    url: str | None = None
    env: Mapping[str, str] | None = None  # None: this process's environment
    cwd: Path | None = None
    echo_command: bool = False  # first log line: "$ <the command>"


class StartError(RuntimeError):
    """A child exited while starting, or was not healthy in time; the message ends with the
    last lines of its log."""


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file ('' if it cannot be read)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Child:
    """A started child; `ready_s` is set by `wait_healthy` (seconds from start to healthy)."""

    spec: ProcessSpec
    process: subprocess.Popen[bytes]
    started_at: float
    ready_s: float | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.spec.log_path, lines)


def die_with_parent_hook() -> Callable[[], None] | None:
    """A preexec_fn for children: SIGINT back to its default, and on Linux PR_SET_PDEATHSIG
    (SIGTERM the child when the thread that forked it dies), both resolved before the fork
    (loading a library in the child of a threaded parent can deadlock).

    SIGINT is reset because a process started in the background by a non-interactive shell
    (`tandem up &` in a script, `nohup`) has it ignored, and an ignored signal stays ignored
    across exec: every child would then shrug off the graceful stop and be killed. The death
    signal is set only from the main thread, whose exit would otherwise fire it early."""
    if sys.platform == "win32":  # pragma: no cover
        return None
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except (OSError, AttributeError):
        return None
    reset_signal = libc.signal
    prctl = None
    if sys.platform == "linux" and threading.current_thread() is threading.main_thread():
        prctl = libc.prctl
    parent = os.getpid()

    def hook() -> None:  # pragma: no cover - runs in the child between fork and exec
        reset_signal(signal.SIGINT, 0)  # SIG_DFL
        if prctl is not None:
            prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent died before the prctl took effect
                os._exit(1)

    return hook


def stop_process(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds; returns once the process is reaped."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start(spec: ProcessSpec) -> Child:
    """Start the child in its own session with its output in `spec.log_path` (truncated)."""
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if spec.env is None else spec.env)
    env.setdefault("PYTHONUNBUFFERED", "1")  # the log shows progress as it happens
    with spec.log_path.open("wb") as log:
        if spec.echo_command:
            log.write(f"$ {shlex.join(spec.argv)}\n".encode())
            log.flush()
        process = subprocess.Popen(
            list(spec.argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=spec.cwd,
            start_new_session=True,
            preexec_fn=die_with_parent_hook(),
        )
    return Child(spec, process, time.monotonic())


def is_healthy(child: Child, timeout: float = 1.0) -> bool:
    """One GET /health (200), for a child already running."""
    if child.spec.url is None:
        return True
    try:
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            return client.get(f"{child.spec.url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(
    children: Sequence[Child],
    timeout: float,
    stop: threading.Event | None = None,
    on_healthy: Callable[[Child], None] | None = None,
    interval: float = 0.25,
) -> None:
    """Until every child answers GET /health with 200, all polled in parallel.

    StartError names the first child that exited, or the ones still not up after `timeout`
    seconds, with the end of their logs. KeyboardInterrupt once `stop` is set (a supervisor
    that catches SIGINT itself sets it), so a start-up can be abandoned at any poll.
    """
    missing = [c.name for c in children if c.spec.url is None]
    if missing:
        raise ValueError(f"no health URL for {', '.join(missing)}")
    pending = list(children)
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while pending:
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
            for child in list(pending):
                code = child.poll()
                if code is not None:
                    raise StartError(
                        f"{child.name} exited with {code} while starting; last lines of "
                        f"{child.spec.log_path}:\n{child.log_tail()}"
                    )
                try:
                    healthy = client.get(f"{child.spec.url}/health").status_code == 200
                except httpx.HTTPError:
                    healthy = False
                if healthy:
                    child.ready_s = time.monotonic() - child.started_at
                    pending.remove(child)
                    if on_healthy is not None:
                        on_healthy(child)
            if pending and time.monotonic() > deadline:
                tails = "\n".join(f"--- {c.spec.log_path}:\n{c.log_tail()}" for c in pending)
                raise StartError(
                    f"not healthy after {timeout:.0f} s: "
                    f"{', '.join(c.name for c in pending)}\n{tails}"
                )
            if pending:
                if stop is not None:
                    stop.wait(interval)
                else:
                    time.sleep(interval)


@dataclass
class RestartPolicy:
    """Restart a child that died, after a growing pause; a crash loop (more than
    `max_restarts` restarts within `window_s`) is given up on. A child that stayed up for
    `window_s` starts over at the shortest pause."""

    max_restarts: int = 5
    window_s: float = 300.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    _times: list[float] = field(default_factory=list)

    def next_delay(self, now: float, ran_s: float) -> float | None:
        """The pause before the next start, or None: a crash loop, give up."""
        if ran_s >= self.window_s:
            self._times.clear()
        self._times = [t for t in self._times if now - t < self.window_s]
        if len(self._times) >= self.max_restarts:
            return None
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** len(self._times))
        self._times.append(now)
        return delay

    @property
    def restarts(self) -> int:
        return len(self._times)


def kill_leftovers(child: Child) -> None:
    """What a child that died left running in its process group (its engine core, say)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)


def stop(children: Sequence[Child], timeout: float = 30.0, log: logging.Logger = logger) -> list[int]:
    """Stop the children and everything they started; returns the pids that had to be killed.

    SIGINT to each child, then up to `timeout` seconds for all of them to exit before SIGKILL;
    their descendants (recorded before the signal) get what is left of the time, at least a
    second, to exit on their own; then the process groups are killed outright. `log` takes
    the warning about a child that had to be killed (the caller's logger, so it reads as the
    caller's line).
    """
    descendants: list[psutil.Process] = []
    for child in children:
        if child.poll() is not None:
            continue  # reaped: its pid may belong to someone else by now
        # Not reaped (running, or a zombie until we wait for it): the pid is still the child's.
        with contextlib.suppress(psutil.NoSuchProcess):
            descendants += psutil.Process(child.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            child.process.send_signal(signal.SIGINT)
    killed = []
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s; killing it", child.name, timeout)
            child.process.kill()
            child.process.wait()
            killed.append(child.pid)
    _, alive = psutil.wait_procs(descendants, timeout=max(1.0, deadline - time.monotonic()))
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
            killed.append(process.pid)
    psutil.wait_procs(alive, timeout=5.0)  # SIGKILL is not instant: gone when we return
    for child in children:
        # Strays no snapshot saw (started after it, or by a child that exited before it).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
    return killed
