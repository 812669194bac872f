"""`tandem up`: a local cluster in one command: prefill + decode workers behind a router.

Every part is a separate `python -m tandem ...` process, started as a user would start it, with
its own log file in the log directory: N `tandem serve --role prefill` and M `--role decode`
workers (or K colocated `--role both` workers with --workers K) on free ports, then
`tandem route` in front of them. Each start is gated on the process's GET /health, workers in
parallel, so the printed endpoint works as soon as it is printed.

Children are started and stopped by `tandem.launch.supervisor`: in their own session, so a terminal's
Ctrl-C reaches only this process, which stops them in order (router first, then workers:
SIGINT, wait, kill, including their own children such as the engine core). On Linux they also
get SIGTERM if this process dies without cleaning up, so a killed `tandem up` leaves no
orphans. A child that exits on its own is restarted after a growing pause while the others
keep serving (the router marks a dead worker down, moves its streams to the others, and takes
it back once its /health answers); only a crash loop (--max-restarts) stops everything, and
`tandem up` then exits non-zero.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tandem.cli import flags
from tandem.edge.limits import add_request_limit_args, request_limit_argv
from tandem.launch import supervisor
from tandem.launch.netns import WorkerNetwork
from tandem.launch.ports import free_port
from tandem.router.accounting.flags import (
    accounting_argv,
    accounting_config,
    add_accounting_args,
    check_accounting,
)
from tandem.router.placement.flags import add_policy_args, policy_argv
from tandem.router.resilience.flags import add_resilience_args, resilience_argv
from tandem.trust.keys import ADMIN_KEY_ENV, admin_key_from_env

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 300.0
_STOP_TIMEOUT_S = 30.0
# Flags of the engine group that `tandem up` sets itself or splits per role.
_OWN_ENGINE_FLAGS = {"--threads", "--kv-offload-disk-path", "--speculative-config"}
# `--kv-store redis` (no URL): `tandem up` runs a redis-server of its own for the cluster tier.
_LOCAL_STORES = ("redis", "valkey")
# Per-role overrides: (flag on `tandem up`, flag passed to that role's workers).
_ROLE_OVERRIDES = {
    "prefill": ("max_num_batched_tokens", "max_num_seqs", "kv_cache_memory"),
    "decode": ("max_num_batched_tokens", "max_num_seqs", "kv_cache_memory"),
}


def add_up_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up",
        help="start a local cluster: prefill + decode workers behind a router",
        description="Start N prefill and M decode workers (`tandem serve --role ...`) and a "
        "`tandem route` in front of them on MODEL; print the endpoint; Ctrl-C stops "
        "everything. Engine flags apply to every worker; --prefill-*/--decode-* "
        "override them per role.",
    )
    flags.add_engine_args(parser)
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument(
        "--prefill-workers", type=int, default=1, metavar="N", help="prefill workers (default: 1)"
    )
    cluster.add_argument(
        "--decode-workers", type=int, default=1, metavar="M", help="decode workers (default: 1)"
    )
    cluster.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="K",
        help="K colocated workers (--role both) instead of prefill + decode",
    )
    cluster.add_argument("--kv-transfer", default="shm", choices=["shm", "tcp"],
                        help="how decode workers fetch prompt KV from prefill workers: shm (through "
                             "/dev/shm, the default: all workers share this host) or tcp")
    cluster.add_argument(
        "--netns",
        action="store_true",
        help="run each worker in a network namespace of its own, joined to the router by a "
        "bridge, as if on its own host (Linux, root): a link can then fail without the "
        "process dying (tandem bench chaos cuts links this way)",
    )
    cluster.add_argument("--host", default="127.0.0.1", help="router address (default: 127.0.0.1)")
    cluster.add_argument("--port", type=int, default=8000, help="router port (default: 8000)")
    cluster.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="one log file per process (default: ./tandem-logs/up-<timestamp>/)",
    )
    cluster.add_argument(
        "--pd-min-prompt-tokens",
        type=int,
        default=256,
        metavar="N",
        help="router: shorter prompts skip the prefill hop (default: 256)",
    )
    cluster.add_argument(
        "--kv-store-memory",
        default="2GiB",
        metavar="SIZE",
        help="with --kv-store redis (no URL): the local redis-server's maxmemory; the oldest "
        "chunks are evicted first (allkeys-lru) (default: 2GiB)",
    )
    cluster.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        metavar="N",
        help="a process that dies is restarted (after 1 s, then 2, 4 ... up to 30 s) while the "
        "others keep serving; more than N restarts of one process within 5 minutes is a crash "
        "loop and stops the cluster; 0 stops it at the first death (default: 5)",
    )
    cluster.add_argument(
        "--start-timeout",
        type=float,
        default=_START_TIMEOUT_S,
        metavar="S",
        help=f"per start-up phase (default: {_START_TIMEOUT_S:.0f})",
    )
    cluster.add_argument(
        "--admin-key",
        default=None,
        metavar="KEY",
        help="bearer token for the control endpoints of the router (drain, resume, reload) and "
        "the workers, handed to them in their environment (default: env TANDEM_ADMIN_KEY, else "
        "the cluster secret, which is written to LOG_DIR/cluster-secret, mode 0600)",
    )
    cluster.add_argument(
        "--public-metrics",
        action="store_true",
        help="keep /metrics and /workers (router) and /metrics, /load (workers) open "
        "to anyone even when keys are on",
    )
    add_policy_args(parser, full=False)  # passed on to the router
    add_resilience_args(parser, full=False)  # passed on to the router
    add_request_limit_args(parser)  # passed on to the router and the workers
    add_accounting_args(parser, worker_key=False)  # passed to the router
    roles = parser.add_argument_group("per-role engine flags (override the engine flags above)")
    for role, names in _ROLE_OVERRIDES.items():
        for name in names:
            flag = name.replace("_", "-")
            roles.add_argument(
                f"--{role}-{flag}",
                dest=f"{role}_{name}",
                default=None,
                metavar="SIZE" if name == "kv_cache_memory" else "N",
                help=f"--{flag} for {role} workers",
            )
    parser.set_defaults(handler=cmd_up)


# --- planning (pure) -------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterPlan:
    model: str
    router: supervisor.ProcessSpec
    workers: tuple[supervisor.ProcessSpec, ...]
    log_dir: Path
    api_keys: bool = False  # the router wants a key: the banner's examples say so
    admin_key_source: str = ""  # what an operator presents to the control plane (the banner says)
    network: WorkerNetwork | None = None  # --netns: the workers' namespaces and bridge


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags the user set (those differing from their defaults), as argv again;
    every worker gets them. --threads is left out: `tandem up` splits the cores itself."""
    return flags.engine_argv(args, exclude=_OWN_ENGINE_FLAGS)


def _role_argv(args: argparse.Namespace, role: str) -> list[str]:
    argv: list[str] = []
    speculative = getattr(args, "speculative_config", None)
    if speculative and role != "prefill":  # prefill workers sample one token: nothing to speculate
        argv += ["--speculative-config", speculative]
    for name in _ROLE_OVERRIDES.get(role, ()):
        value = getattr(args, f"{role}_{name}", None)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def worker_roles(args: argparse.Namespace) -> list[str]:
    if args.workers is not None:
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        return ["both"] * args.workers
    if args.prefill_workers < 1 or args.decode_workers < 1:
        raise ValueError("--prefill-workers and --decode-workers must be >= 1 (or use --workers K)")
    return ["prefill"] * args.prefill_workers + ["decode"] * args.decode_workers


def default_threads(num_workers: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // num_workers)


def _worker_gpus(args: argparse.Namespace, workers: int) -> list[str]:
    """On a GPU host, one GPU per worker (each sees only its own, as CUDA_VISIBLE_DEVICES):
    each sizes its KV cache from 90% of its device, so two on one GPU would not fit. Empty on
    the CPU. Torch-free: the router's process plans the cluster."""
    from tandem.platform.device import gpu_ids, resolve_device

    if resolve_device(getattr(args, "device", "auto")) != "cuda":
        return []
    ids = gpu_ids()
    if len(ids) < workers:
        raise ValueError(f"--device cuda: {workers} workers need a GPU each, this host shows {len(ids)}; "
                         "use fewer workers or more GPUs")
    return ids[:workers]


def plan_cluster(
    args: argparse.Namespace,
    tokenizer_dir: Path | None,
    free_port: Callable[[], int],
    secret: str | None = None,
) -> ClusterPlan:
    roles = worker_roles(args)
    log_dir = args.log_dir or Path("tandem-logs") / f"up-{dt.datetime.now():%Y%m%d-%H%M%S}"
    threads = args.threads or default_threads(len(roles))
    python = [sys.executable, "-m", "tandem", "--log-level", args.log_level]
    common = engine_argv(args)
    counts: dict[str, int] = {}
    workers = []
    taken: set[int] = {args.port}
    # Workers answer only requests their router signs, and their KV ports serve only each
    # other: one secret per cluster, passed in the environment so that it appears on no
    # command line (tandem/trust); the admin key likewise.
    secret = secret or cluster_secret()
    secrets_env = {flags.CLUSTER_SECRET_ENV: secret}
    admin_key = admin_key_from_env(getattr(args, "admin_key", None))
    if admin_key:
        secrets_env[ADMIN_KEY_ENV] = admin_key
    public = ["--public-metrics"] if getattr(args, "public_metrics", False) else []
    network = WorkerNetwork(args.port) if getattr(args, "netns", False) else None

    def distinct_port() -> int:
        """A free port no other process of this cluster was given."""
        while True:
            port = free_port()
            if port not in taken:
                taken.add(port)
                return port

    gpus = _worker_gpus(args, len(roles))
    for role in roles:
        index = counts.get(role, 0)
        counts[role] = index + 1
        name = f"{'worker' if role == 'both' else role}-{index}"
        port = distinct_port()
        host = network.address(name) if network else "127.0.0.1"
        argv = [
            *(network.exec_prefix(name) if network else []),
            *python,
            "serve",
            args.model,
            "--host",
            host,
            "--port",
            str(port),
            "--no-access-log",
            "--threads",
            str(threads),
            *common,
            *_role_argv(args, role),
            *request_limit_argv(args),
            *public,
            "--role",
            role,
        ]
        if args.kv_offload_disk_path:
            # One directory per worker: each keeps its own disk budget and LRU.
            argv += ["--kv-offload-disk-path", str(Path(args.kv_offload_disk_path) / name)]
        if role != "decode":
            # Chosen here, not by the worker: a KV source binding a random port of its own
            # could take the HTTP port just handed to the next worker.
            argv += ["--kv-transfer-port", str(distinct_port())]
            if network:
                argv += ["--kv-transfer-host", host]
        if role != "decode" and args.kv_transfer != "tcp":
            # Every worker shares this host: decode workers copy prompt KV straight out
            # of the prefill worker's cache file instead of over a socket.
            argv += ["--kv-transfer-shm"]
        workers.append(
            supervisor.ProcessSpec(
                name,
                tuple(argv),
                log_dir / f"{name}.log",
                url=f"http://{host}:{port}",
                env={**os.environ, **secrets_env,
                     **({"CUDA_VISIBLE_DEVICES": gpus[len(workers)]} if gpus else {})},
            )
        )
    router_argv = [
        *python,
        "route",
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--pd-min-prompt-tokens",
        str(args.pd_min_prompt_tokens),
        *policy_argv(args),
        *resilience_argv(args),
        *request_limit_argv(args),
        *public,
    ]
    role_flags = {"prefill": "--prefill", "decode": "--decode", "both": "--worker"}
    for role, worker in zip(roles, workers, strict=True):
        router_argv += [role_flags[role], worker.url]
    if tokenizer_dir is not None:
        router_argv += ["--tokenizer", str(tokenizer_dir)]
    router_argv += accounting_argv(args)
    shown_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    router = supervisor.ProcessSpec(
        "router", tuple(router_argv), log_dir / "router.log", url=f"http://{shown_host}:{args.port}",
        env={**os.environ, **secrets_env},
    )
    if admin_key:
        admin_source = "the --admin-key"
    elif os.environ.get(flags.CLUSTER_SECRET_ENV):
        admin_source = f"${flags.CLUSTER_SECRET_ENV}"
    else:
        admin_source = f"the cluster secret in {log_dir / 'cluster-secret'}"
    return ClusterPlan(
        args.model, router, tuple(workers), log_dir, api_keys=args.api_keys is not None,
        admin_key_source=admin_source, network=network,
    )


def cluster_secret() -> str:
    """The one the user gave (env), else a fresh one for this cluster."""
    return os.environ.get(flags.CLUSTER_SECRET_ENV) or secrets.token_hex(32)


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


# --- processes -------------------------------------------------------------------------
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


def banner(plan: ClusterPlan) -> str:
    url = plan.router.url
    counts: dict[str, int] = {}
    for worker in plan.workers:
        role = worker.name.rsplit("-", 1)[0]
        counts[role] = counts.get(role, 0) + 1
    shape = " + ".join(f"{n} {role}" for role, n in counts.items())
    lines = [f"tandem up: {shape} worker(s) serving {plan.model}; OpenAI endpoint {url}/v1", ""]
    for process in (*plan.workers, plan.router):
        lines.append(f"  {process.name:<10} {process.url:<24} log: {process.log_path}")
    chat = json.dumps({"model": plan.model, "messages": [{"role": "user", "content": "Hello!"}]})
    auth = " -H 'Authorization: Bearer $KEY'" if plan.api_keys else ""
    client_key = "<KEY>" if plan.api_keys else "unused"
    lines += [
        "",
        "curl:" + (" (KEY: a key from the --api-keys file)" if plan.api_keys else ""),
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\",
        f"    -d '{chat}'",
        "",
        "openai-python:",
        "  from openai import OpenAI",
        f'  client = OpenAI(base_url="{url}/v1", api_key="{client_key}")',
        "  reply = client.chat.completions.create(",
        f'      model="{plan.model}", messages=[{{"role": "user", "content": "Hello!"}}])',
        "  print(reply.choices[0].message.content)",
        "",
        f"Control plane (POST {url}/workers/HOST:PORT/drain, /resume, /workers/reload): "
        f"'Authorization: Bearer <{plan.admin_key_source}>'.",
        "Ctrl-C stops the cluster.",
    ]
    return "\n".join(lines)


def cmd_up(args: argparse.Namespace) -> int:
    flags.settle_device(args)  # --dtype auto -> this host's dtype (the CLI did it; direct callers may not)
    from tandem.loader.resolve import resolve_model

    worker_roles(args)  # bad counts fail before anything starts
    check_accounting(accounting_config(args))  # so do bad price / key files
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    _check_port_free(args.host, args.port)
    if args.netns:
        from tandem.launch import netns

        reason = netns.available()
        if reason:
            raise ValueError(f"--netns: {reason}")
        if args.kv_store:
            raise ValueError("--netns does not reach a --kv-store: the namespaces see only "
                             "their bridge; leave one of them out")
    # Resolve (and, for a GGUF, convert) once here rather than in N workers at once; the
    # router counts prompt tokens with the same tokenizer.json.
    resolved = resolve_model(args.model, args.dtype)
    tokenizer_dir = resolved.hf_dir if (resolved.hf_dir / "tokenizer.json").is_file() else None
    log_dir = args.log_dir or Path("tandem-logs") / f"up-{dt.datetime.now():%Y%m%d-%H%M%S}"
    args.log_dir = log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    secret = cluster_secret()
    if not os.environ.get(flags.CLUSTER_SECRET_ENV):
        write_secret(log_dir / "cluster-secret", secret)  # for an operator's control-plane calls
    store = start_local_store(args, log_dir, secret)
    plan = plan_cluster(args, tokenizer_dir, free_port, secret)
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        if plan.network is not None:
            plan.network.create()
        return Cluster(plan, args.start_timeout, stop, args.max_restarts).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if plan.network is not None:
            plan.network.remove()
        if store is not None:
            store.stop()


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
