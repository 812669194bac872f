"""`tandem.launch.supervisor` with real child processes: a tiny HTTP server, a child that starts a
grandchild, one that never gets healthy, one that ignores SIGINT, and a supervisor killed
outright. Stopping must leave no process behind."""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tandem.launch import supervisor
from tandem.platform.ports import free_port

# argv[1]: port; argv[2] (optional): "grandchild" starts a sleeper in a session of its own
# (out of reach of the child's process group) and "stray" one in the child's own group.
HEALTH_SERVER = textwrap.dedent("""
    import http.server, signal, subprocess, sys
    if len(sys.argv) > 2:
        own_session = sys.argv[2] == "grandchild"
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                   start_new_session=own_session)
        print("grandchild", sleeper.pid, flush=True)
    if len(sys.argv) > 3 and sys.argv[3] == "ignore-sigint":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    print("serving", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
""")



@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "health_server.py"
    path.write_text(HEALTH_SERVER)
    return path


@pytest.fixture
def started() -> Iterator[list[supervisor.Child]]:
    """Children a test started; whatever a failed test left running is killed here."""
    children: list[supervisor.Child] = []
    yield children
    for child in children:
        if child.poll() is None:
            child.process.kill()
            child.process.wait()


def _server(tmp_path: Path, script: Path, *extra: str) -> supervisor.ProcessSpec:
    port = free_port()
    return supervisor.ProcessSpec(
        "health", (sys.executable, str(script), str(port), *extra), tmp_path / "logs" / "health.log",
        url=f"http://127.0.0.1:{port}",
    )


def _grandchild(child: supervisor.Child) -> psutil.Process:
    match = re.search(r"^grandchild (\d+)$", child.spec.log_path.read_text(), re.MULTILINE)
    assert match, child.log_tail()
    return psutil.Process(int(match.group(1)))


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_healthy_child_is_stopped_with_sigint(
    tmp_path: Path, script: Path, started: list[supervisor.Child]
) -> None:
    spec = _server(tmp_path, script)
    child = supervisor.start(spec)
    started.append(child)
    healthy: list[str] = []
    supervisor.wait_healthy([child], 30, on_healthy=lambda c: healthy.append(c.name))
    assert healthy == ["health"] and child.ready_s is not None and 0 < child.ready_s < 30
    assert child.poll() is None
    assert supervisor.stop([child], timeout=10) == []  # it stopped on SIGINT: nothing killed
    # SIGINT, not SIGKILL: Python ended on KeyboardInterrupt (and exits "killed by SIGINT")
    assert child.process.returncode == -signal.SIGINT and "KeyboardInterrupt" in child.log_tail()
    assert child.log_tail().splitlines()[0] == "serving"  # the log starts with the child's output


def test_stop_leaves_no_grandchild_behind(
    tmp_path: Path, script: Path, started: list[supervisor.Child]
) -> None:
    """A grandchild in a session of its own outlives its parent's SIGINT: stop kills it."""
    child = supervisor.start(_server(tmp_path, script, "grandchild"))
    started.append(child)
    supervisor.wait_healthy([child], 30)
    grandchild = _grandchild(child)
    assert grandchild.ppid() == child.pid and grandchild.is_running()
    killed = supervisor.stop([child], timeout=1.0)
    assert killed == [grandchild.pid]  # the child itself exited on SIGINT
    assert child.poll() is not None and _gone(grandchild.pid)


def test_stop_after_the_child_exited_kills_strays_in_its_group(
    tmp_path: Path, script: Path, started: list[supervisor.Child]
) -> None:
    """A child that exits on its own leaves its helpers orphaned (no longer its descendants):
    they are still in its process group, and stop kills that group."""
    child = supervisor.start(_server(tmp_path, script, "stray"))
    started.append(child)
    supervisor.wait_healthy([child], 30)
    stray = _grandchild(child)
    child.process.kill()
    child.process.wait()
    assert stray.is_running() and not _gone(stray.pid)
    supervisor.stop([child], timeout=1.0)
    deadline = time.monotonic() + 10
    while not _gone(stray.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(stray.pid)


def test_a_child_ignoring_sigint_is_killed(
    tmp_path: Path, script: Path, started: list[supervisor.Child], caplog: pytest.LogCaptureFixture
) -> None:
    child = supervisor.start(_server(tmp_path, script, "grandchild", "ignore-sigint"))
    started.append(child)
    supervisor.wait_healthy([child], 30)
    grandchild = _grandchild(child)
    log = logging.getLogger("tandem.test_supervisor")
    with caplog.at_level(logging.WARNING, logger=log.name):
        killed = supervisor.stop([child], timeout=1.0, log=log)
    assert killed == [child.pid, grandchild.pid]
    assert child.process.returncode == -signal.SIGKILL and _gone(grandchild.pid)
    assert [r.getMessage() for r in caplog.records] == ["health did not stop within 1 s; killing it"]


def test_never_healthy_is_a_timeout_with_the_log_tail(
    tmp_path: Path, started: list[supervisor.Child]
) -> None:
    code = "import time; print('loading weights', flush=True); time.sleep(600)"
    spec = supervisor.ProcessSpec(
        "slow", (sys.executable, "-c", code), tmp_path / "slow.log", url=f"http://127.0.0.1:{free_port()}"
    )
    child = supervisor.start(spec)
    started.append(child)
    began = time.monotonic()
    with pytest.raises(supervisor.StartError) as error:
        supervisor.wait_healthy([child], 1.0)
    assert 1.0 <= time.monotonic() - began < 10
    assert str(error.value) == f"not healthy after 1 s: slow\n--- {spec.log_path}:\nloading weights"
    supervisor.stop([child], timeout=5)
    assert child.poll() is not None


def test_exit_while_starting_names_the_child_and_its_log(
    tmp_path: Path, started: list[supervisor.Child]
) -> None:
    code = "import sys; print('loading weights'); print('fatal: out of memory'); sys.exit(3)"
    spec = supervisor.ProcessSpec(
        "bad", (sys.executable, "-c", code), tmp_path / "bad.log",
        url=f"http://127.0.0.1:{free_port()}", echo_command=True,
    )
    child = supervisor.start(spec)
    started.append(child)
    with pytest.raises(supervisor.StartError) as error:
        supervisor.wait_healthy([child], 30)
    assert str(error.value).splitlines()[0] == f"bad exited with 3 while starting; last lines of {spec.log_path}:"
    assert str(error.value).splitlines()[-2:] == ["loading weights", "fatal: out of memory"]
    assert spec.log_path.read_text().splitlines()[0].startswith(f"$ {sys.executable} -c ")


def test_a_set_stop_event_abandons_the_wait(tmp_path: Path, started: list[supervisor.Child]) -> None:
    spec = supervisor.ProcessSpec(
        "idle", (sys.executable, "-c", "import time; time.sleep(600)"), tmp_path / "idle.log",
        url=f"http://127.0.0.1:{free_port()}",
    )
    child = supervisor.start(spec)
    started.append(child)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    with pytest.raises(KeyboardInterrupt):
        supervisor.wait_healthy([child], 60, stop)
    supervisor.stop([child], timeout=5)
    assert child.poll() is not None


def test_env_and_cwd(tmp_path: Path, started: list[supervisor.Child]) -> None:
    code = "import os; print(os.getcwd(), os.environ.get('MARK'), os.environ.get('PYTHONUNBUFFERED'))"
    spec = supervisor.ProcessSpec(
        "env", (sys.executable, "-c", code), tmp_path / "env.log", env={"MARK": "m1"}, cwd=tmp_path
    )
    child = supervisor.start(spec)
    started.append(child)
    assert child.process.wait(30) == 0
    assert child.log_tail() == f"{tmp_path} m1 1"
    with pytest.raises(ValueError, match="no health URL for env"):
        supervisor.wait_healthy([child], 1)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_supervisor_leaves_no_orphan(tmp_path: Path) -> None:
    """SIGKILL gives the supervisor no chance to stop anything: the kernel sends its
    children SIGTERM."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from tandem.launch import supervisor
        child = supervisor.start(supervisor.ProcessSpec(
            "sleeper", (sys.executable, "-c", "import time; time.sleep(600)"),
            Path({str(tmp_path / "sleeper.log")!r})))
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.is_running() and child.ppid() == parent.pid
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while not _gone(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child.pid)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_child_of_a_process_ignoring_sigint_still_stops_on_sigint(
    tmp_path: Path, script: Path, started: list[supervisor.Child]
) -> None:
    """Started from a background job, this process has SIGINT ignored, which exec keeps: the
    child must get it back, or every graceful stop would end in SIGKILL."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = supervisor.start(_server(tmp_path, script))
    finally:
        signal.signal(signal.SIGINT, previous)
    started.append(child)
    supervisor.wait_healthy([child], 30)
    assert supervisor.stop([child], timeout=10) == []
    assert child.process.returncode == -signal.SIGINT


def test_restart_policy_backs_off_and_gives_up_on_a_crash_loop() -> None:
    policy = supervisor.RestartPolicy(max_restarts=3, window_s=100.0, backoff_s=1.0, max_backoff_s=3.0)
    assert [policy.next_delay(t, ran_s=1.0) for t in (0.0, 5.0, 10.0)] == [1.0, 2.0, 3.0]  # capped
    assert policy.next_delay(15.0, ran_s=1.0) is None  # a 4th death within 100 s: a crash loop
    # Restarts older than the window no longer count, and a child that ran a whole window
    # starts over at the shortest pause.
    assert policy.next_delay(108.0, ran_s=1.0) == 2.0  # only the restart at 10 s is left
    assert policy.next_delay(300.0, ran_s=150.0) == 1.0
    never = supervisor.RestartPolicy(max_restarts=0)
    assert never.next_delay(0.0, ran_s=1.0) is None  # --max-restarts 0: the first death stops all
