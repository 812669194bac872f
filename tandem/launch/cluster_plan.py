"""The plan of a `tandem up` cluster: which processes, with which argv, ports, threads, GPUs
and environment. Pure apart from reading the environment and the GPU list: it starts
nothing, so a test can check what every process would be given (`plan_cluster` with a fake
`free_port`). The running cluster is `tandem.launch.cluster`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tandem.edge.protocols.response_store import is_redis_url
from tandem.flags import engine as flags
from tandem.flags.limits import request_limit_argv
from tandem.launch import supervisor
from tandem.launch.netns import WorkerNetwork
from tandem.launch.up_flags import ROLE_OVERRIDES, worker_roles
from tandem.router.accounting.flags import accounting_argv
from tandem.router.placement.flags import policy_argv
from tandem.router.resilience.flags import resilience_argv
from tandem.trust.keys import ADMIN_KEY_ENV, admin_key_from_env

# Flags of the engine group that `tandem up` sets itself or splits per role.
_OWN_ENGINE_FLAGS = {"--threads", "--kv-offload-disk-path", "--speculative-config"}


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
    for name in ROLE_OVERRIDES.get(role, ()):
        value = getattr(args, f"{role}_{name}", None)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


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
        if getattr(args, "override_generation_config", None):
            argv += ["--override-generation-config", args.override_generation_config]
        if role != "prefill" and getattr(args, "kv_transfer_dtype", "auto") != "auto":
            argv += ["--kv-transfer-dtype", args.kv_transfer_dtype]  # the fetching side asks for it
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
    kv_store = getattr(args, "kv_store", None)
    if is_redis_url(kv_store):  # the workers' Redis keeps the router's responses too
        router_argv += ["--response-store", kv_store]
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
