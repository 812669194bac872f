"""`tandem up`'s flags: its own cluster table and the per-role overrides, beside the parts of
the engine, routing-policy, fault, request-limit and accounting tables it takes and passes on
to the processes it starts (each a subset of the table `tandem serve` or `tandem route`
registers, so the two cannot drift apart).

`check_up` builds everything a bad command line could break (worker counts, the router's
flags, price and key files, --netns with a --kv-store) at parse time, so the command fails
with one line before any process starts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tandem.config import GenerationDefaults
from tandem.flags.limits import REQUEST_LIMIT_FLAGS, request_limit_argv
from tandem.flags.table import Flag, FlagTable
from tandem.router.accounting.flags import UP_ACCOUNTING_FLAGS, accounting_config, check_accounting
from tandem.router.placement.flags import UP_POLICY_FLAGS, policy_argv
from tandem.router.resilience.flags import UP_RESILIENCE_FLAGS, resilience_argv

START_TIMEOUT_S = 300.0
# Per-role overrides: (flag on `tandem up`, flag passed to that role's workers).
ROLE_OVERRIDES = {
    "prefill": ("max_num_batched_tokens", "max_num_seqs", "kv_cache_memory"),
    "decode": ("max_num_batched_tokens", "max_num_seqs", "kv_cache_memory"),
}
CLUSTER_FLAGS = FlagTable("cluster", (
    Flag("--prefill-workers", "prefill workers (default: 1)", 1, type=int, metavar="N"),
    Flag("--decode-workers", "decode workers (default: 1)", 1, type=int, metavar="M"),
    Flag(
        "--workers", type=int, metavar="K",
        help="K colocated workers (--role both) instead of prefill + decode",
    ),
    Flag(
        "--kv-transfer", default="shm", choices=["shm", "tcp"],
        help="how decode workers fetch prompt KV from prefill workers: shm (through "
        "/dev/shm, the default: all workers share this host) or tcp",
    ),
    Flag(
        "--kv-transfer-dtype", default="auto", choices=["auto", "bfloat16", "int8", "int4"],
        help="with --kv-transfer tcp: the prompt KV's bytes on the wire (the decode workers' "
        "--kv-transfer-dtype: int8 / int4 are 0.53x / 0.29x of bf16's) (default: auto, the "
        "cache's own)",
    ),
    Flag(
        "--override-generation-config", metavar="JSON",
        help="every worker's sampling defaults for requests that leave a field out (tandem "
        "serve's flag, vLLM's): e.g. '{\"temperature\": 0.7, \"max_new_tokens\": 2048}'",
    ),
    Flag(
        "--netns", switch=True,
        help="run each worker in a network namespace of its own, joined to the router by a "
        "bridge, as if on its own host (Linux, root): a link can then fail without the "
        "process dying (tandem bench chaos cuts links this way)",
    ),
    Flag("--host", "router address (default: 127.0.0.1)", "127.0.0.1"),
    Flag("--port", "router port (default: 8000)", 8000, type=int),
    Flag(
        "--log-dir", type=Path,
        help="one log file per process (default: ./tandem-logs/up-<timestamp>/)",
    ),
    Flag(
        "--pd-min-prompt-tokens", default=256, type=int, metavar="N",
        help="router: shorter prompts skip the prefill hop (default: 256)",
    ),
    Flag(
        "--kv-store-memory", default="2GiB", metavar="SIZE",
        help="with --kv-store redis (no URL): the local redis-server's maxmemory; the oldest "
        "chunks are evicted first (allkeys-lru) (default: 2GiB)",
    ),
    Flag(
        "--max-restarts", default=5, type=int, metavar="N",
        help="a process that dies is restarted (after 1 s, then 2, 4 ... up to 30 s) while the "
        "others keep serving; more than N restarts of one process within 5 minutes is a crash "
        "loop and stops the cluster; 0 stops it at the first death (default: 5)",
    ),
    Flag(
        "--start-timeout", default=START_TIMEOUT_S, type=float, metavar="S",
        help=f"per start-up phase (default: {START_TIMEOUT_S:.0f})",
    ),
    Flag(
        "--admin-key", metavar="KEY",
        help="bearer token for the control endpoints of the router (drain, resume, reload) and "
        "the workers, handed to them in their environment (default: env TANDEM_ADMIN_KEY, else "
        "the cluster secret, which is written to LOG_DIR/cluster-secret, mode 0600)",
    ),
    Flag(
        "--public-metrics", switch=True,
        help="keep /metrics and /workers (router) and /metrics, /load (workers) open "
        "to anyone even when keys are on",
    ),
))

ROLE_FLAGS = FlagTable("per-role engine flags (override the engine flags above)", tuple(
    Flag(f"--{role}-{name.replace('_', '-')}", f"--{name.replace('_', '-')} for {role} workers",
         dest_name=f"{role}_{name}", metavar="SIZE" if name == "kv_cache_memory" else "N")
    for role, names in ROLE_OVERRIDES.items()
    for name in names
))


def add_up_flags(parser: argparse.ArgumentParser) -> None:
    """Everything after the engine flags, in --help order."""
    CLUSTER_FLAGS.add_to(parser)
    UP_POLICY_FLAGS.add_to(parser)  # passed on to the router
    UP_RESILIENCE_FLAGS.add_to(parser)  # passed on to the router
    REQUEST_LIMIT_FLAGS.add_to(parser)  # passed on to the router and the workers
    UP_ACCOUNTING_FLAGS.add_to(parser)  # passed to the router
    ROLE_FLAGS.add_to(parser)


def worker_roles(args: argparse.Namespace) -> list[str]:
    """The role of every worker, in start order, from --workers or --prefill/--decode-workers."""
    if args.workers is not None:
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        return ["both"] * args.workers
    if args.prefill_workers < 1 or args.decode_workers < 1:
        raise ValueError("--prefill-workers and --decode-workers must be >= 1 (or use --workers K)")
    return ["prefill"] * args.prefill_workers + ["decode"] * args.decode_workers


def check_up(args: argparse.Namespace) -> None:
    """What a bad command line could break, built once before anything starts."""
    worker_roles(args)
    policy_argv(args)
    resilience_argv(args)
    request_limit_argv(args)
    GenerationDefaults.from_json(args.override_generation_config)
    check_accounting(accounting_config(args))  # bad price / key files, an unusable ledger
    if args.netns and args.kv_store:
        raise ValueError("--netns does not reach a --kv-store: the namespaces see only "
                         "their bridge; leave one of them out")
