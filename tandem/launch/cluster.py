"""A running `tandem up` cluster: start the planned processes, wait for their /health, watch
them (restarting one that dies, stopping everything on a crash loop) and stop them in order.
What runs is decided by `tandem.launch.cluster_plan`; this module only carries it out.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
import time
from pathlib import Path

from tandem.launch import supervisor
from tandem.launch.cluster_plan import ClusterPlan, banner

# Named after the command, not this module: operators and `tandem bench chaos` read
# "tandem.launch.up: <worker> is healthy again" in the log.
logger = logging.getLogger("tandem.launch.up")

_STOP_TIMEOUT_S = 30.0
# `--kv-store redis` (no URL): `tandem up` runs a redis-server of its own for the cluster tier.
_LOCAL_STORES = ("redis", "valkey")


def write_secret(path: Path, secret: str) -> None:
    """The secret in a file only this user may read (created 0600, never world-readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secret + "\n")


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host if host not in ("", "::") else "0.0.0.0", port))
        except OSError as exc:
            raise ValueError(
                f"cannot use port {port} for the router: {exc.strerror}; pick another with --port"
            ) from exc


def launch(spec: supervisor.ProcessSpec) -> supervisor.Child:
    """Start one process of the cluster and log where it runs and where its log goes."""
    child = supervisor.start(spec)
    logger.info("started %s (pid %d) on %s; log: %s", spec.name, child.pid, spec.url, spec.log_path)
    return child


def wait_healthy(
    children: list[supervisor.Child], timeout: float, stop: threading.Event
) -> None:
    """Until every child answers GET /health; supervisor.StartError (a RuntimeError) names
    the first that exited or the ones still not up at the deadline."""
    supervisor.wait_healthy(
        children, timeout, stop, on_healthy=lambda child: logger.info("%s is healthy", child.name)
    )


def stop_children(children: list[supervisor.Child], timeout: float = _STOP_TIMEOUT_S) -> list[int]:
    """SIGINT (as Ctrl-C would), wait, then SIGKILL what is left, descendants included.
    Returns the pids that had to be killed."""
    return supervisor.stop(children, timeout, log=logger)


class Cluster:
    """The running processes; `run` is the whole life of `tandem up`."""

    def __init__(
        self, plan: ClusterPlan, start_timeout: float, stop: threading.Event, max_restarts: int = 5
    ) -> None:
        self.max_restarts = max_restarts
        self.plan = plan
        self.start_timeout = start_timeout
        self.stop = stop
        self.workers: list[supervisor.Child] = []
        self.router: supervisor.Child | None = None

    def run(self) -> int:
        try:
            self.workers = [launch(p) for p in self.plan.workers]
            wait_healthy(self.workers, self.start_timeout, self.stop)
            self.router = launch(self.plan.router)
            wait_healthy([self.router], self.start_timeout, self.stop)
        except KeyboardInterrupt:
            logger.info("interrupted while starting; stopping")
            self.shutdown()
            return 130
        except RuntimeError as exc:
            logger.error("%s", exc)
            self.shutdown()
            return 1
        print(banner(self.plan), flush=True)
        code = self.watch()
        self.shutdown()
        return code

    def watch(self) -> int:
        """Until a stop signal (0), restarting children that die, or a crash loop (1)."""
        children = [*self.workers, *([self.router] if self.router else [])]
        policies = {c.name: supervisor.RestartPolicy(max_restarts=self.max_restarts) for c in children}
        due: dict[str, tuple[float, supervisor.ProcessSpec]] = {}  # name -> (start at, spec)
        rejoining: dict[str, supervisor.Child] = {}
        while not self.stop.wait(0.5):
            now = time.monotonic()
            for child in list(children):
                code = child.poll()
                if code is None:
                    continue
                children.remove(child)
                rejoining.pop(child.name, None)
                supervisor.kill_leftovers(child)
                delay = policies[child.name].next_delay(now, now - child.started_at)
                tail = f"Last lines of {child.spec.log_path}:\n{child.log_tail()}"
                if delay is None:
                    logger.error(
                        "%s exited with %s, its %s crash in %.0f s; giving up and stopping the "
                        "cluster. %s",
                        child.name, code, _ordinal(self.max_restarts + 1),
                        policies[child.name].window_s, tail,
                    )
                    return 1
                logger.error(
                    "%s exited unexpectedly with %s; restarting it in %.0f s (restart %d of at "
                    "most %d in %.0f s); the other processes keep serving. %s",
                    child.name, code, delay, policies[child.name].restarts, self.max_restarts,
                    policies[child.name].window_s, tail,
                )
                due[child.name] = (now + delay, child.spec)
            for name, (at, spec) in list(due.items()):
                if at <= now:
                    del due[name]
                    child = launch(spec)
                    self._replace(child)
                    children.append(child)
                    rejoining[name] = child
            for name, child in list(rejoining.items()):
                if child.poll() is None and supervisor.is_healthy(child):
                    del rejoining[name]
                    logger.info("%s is healthy again after %.1f s; the router takes it back",
                                name, time.monotonic() - child.started_at)
        logger.info("stopping the cluster")
        return 0

    def _replace(self, child: supervisor.Child) -> None:
        if self.router is not None and child.name == self.router.name:
            self.router = child
            return
        self.workers = [child if w.name == child.name else w for w in self.workers]

    def shutdown(self) -> None:
        if self.router is not None:
            stop_children([self.router])
        stop_children(self.workers)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def start_local_store(  # noqa: ANN201 - RedisServer | None
    args: argparse.Namespace, log_dir: Path, secret: str | None = None
):
    """`--kv-store redis`: start a redis-server for the cluster KV tier and point the workers
    at it (args.kv_store becomes its URL). It requires `secret`, the cluster's, which the
    workers have in their environment and present as its password."""
    if (args.kv_store or "").lower() not in _LOCAL_STORES:
        return None
    from tandem.config import parse_memory_size
    from tandem.launch.redis_server import RedisServer

    server = RedisServer(maxmemory_bytes=parse_memory_size(args.kv_store_memory),
                         log_path=log_dir / "redis.log", password=secret).start()
    logger.info("cluster KV store: redis-server on %s (maxmemory %s, allkeys-lru%s)", server.url,
                args.kv_store_memory, ", the cluster secret as its password" if secret else "")
    args.kv_store = server.url
    return server
