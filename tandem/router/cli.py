"""`tandem route`: flags → RouterConfig → the router's uvicorn server."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tandem.edge.protocols.response_store import MEMORY, check_store_url
from tandem.flags.limits import REQUEST_LIMIT_FLAGS, request_limits
from tandem.flags.table import Command, Flag, FlagTable
from tandem.router.accounting.flags import (
    ACCOUNTING_FLAGS,
    accounting_config,
    check_accounting,
)
from tandem.router.config import (
    DiscoveryTarget,
    HealthPolicy,
    RetryPolicy,
    RouterConfig,
    ScoringConfig,
    Timeouts,
    all_worker_specs,
    parse_discovery_target,
    specs_from_lists,
)
from tandem.router.placement.flags import POLICY_FLAGS, policy_config
from tandem.router.resilience.flags import (
    RESILIENCE_FLAGS,
    admission_policy,
    breaker_policy,
)
from tandem.trust.keys import CLUSTER_SECRET_ENV, admin_key_from_env, secret_from_env

_DESCRIPTION = """\
One OpenAI endpoint in front of tandem workers. Long prompts are split into a prefill hop
(on a --prefill worker, max_tokens=1) and a decode hop (on a --decode or --worker worker) and
merged into one response; short prompts, n>1 and logprobs go whole to one decode/colocated
worker. By default (--policy kv_aware) the first hop goes to the worker that already holds
the longest prefix of the prompt's KV, weighed against its queue; requests with an
x-session-affinity header (or --affinity-header, or a `user` field) stick to one worker by
consistent hashing with bounded loads. Workers are polled every --health-interval seconds,
marked down after --down-after failures and up after --up-after successes. Failures before
the client saw a byte are retried on another worker; a stream whose worker fails after
that continues on another worker (--migration-limit).

Worker file (--config, JSON or YAML; POST /workers/reload or SIGHUP re-reads it):
  {"prefill": ["http://10.0.0.1:8001"], "decode": ["http://10.0.0.2:8001"], "worker": []}

On Kubernetes, discover workers from headless Services instead (deploy/k8s/):
  --discover prefill=tandem-prefill:8000 --discover decode=tandem-decode:8000
"""


def _discovery_target(text: str) -> DiscoveryTarget:
    try:
        return parse_discovery_target(text)
    except ValueError as exc:  # argparse then prints the reason, not "invalid value"
        raise argparse.ArgumentTypeError(str(exc)) from exc


ROUTE_WORKER_FLAGS = FlagTable("workers", (
    Flag(
        "--prefill", default=[], metavar="URL", action="append",
        help="prefill worker (repeatable)",
    ),
    Flag(
        "--decode", default=[], metavar="URL", action="append",
        help="decode worker; also serves short requests whole (repeatable)",
    ),
    Flag(
        "--worker", default=[], metavar="URL", action="append",
        help="colocated worker (--role both): whole requests and decode hops (repeatable)",
    ),
    Flag(
        "--config", type=Path, metavar="FILE",
        help="JSON/YAML file {prefill: [...], decode: [...], worker: [...]}, added to the flags",
    ),
    Flag(
        "--discover", default=[], type=_discovery_target, metavar="ROLE=HOST:PORT",
        action="append",
        help="workers of ROLE (prefill, decode or worker) at every address HOST resolves to, "
        "re-resolved every --discover-interval: a Kubernetes headless Service lists its ready "
        "pods (repeatable)",
    ),
    Flag(
        "--discover-interval", default=5.0, type=float, metavar="S",
        help="seconds between --discover lookups (default: 5)",
    ),
))

ROUTE_SERVER_FLAGS = FlagTable("server", (
    Flag("--host", help="address to bind (default: 127.0.0.1)", default="127.0.0.1"),
    Flag("--port", help="port (default: 8000)", default=8000, type=int),
    Flag("--access-log", help="log every HTTP request (uvicorn)", switch=True),
))

ROUTING_FLAGS = FlagTable("routing", (
    Flag(
        "--tokenizer", type=Path, metavar="PATH",
        help="tokenizer.json or a model directory holding one, to count prompt "
        "tokens (default: estimate 4 characters per token)",
    ),
    Flag(
        "--pd-min-prompt-tokens", default=256, type=int, metavar="N",
        help="shorter prompts skip the prefill hop (default: 256)",
    ),
    Flag(
        "--decode-sequence-weight", default=ScoringConfig.decode_sequence_weight, type=float,
        metavar="W",
        help="decode score per running sequence, next to the KV fraction "
        f"in use (default: {ScoringConfig.decode_sequence_weight})",
    ),
    Flag(
        "--response-store", default=MEMORY, metavar="URL",
        help="where /v1/responses keeps responses for previous_response_id and GET "
        "/v1/responses/ID: 'memory' (this router's, bounded) or redis://HOST:PORT / valkey://... "
        "that every router replica shares; the cluster secret is its password unless the URL "
        "has one (default: memory; tandem up passes its Redis --kv-store)",
    ),
))

HEALTH_FLAGS = FlagTable("health and retries", (
    Flag(
        "--health-interval", default=HealthPolicy.interval_s, type=float, metavar="S",
        help=f"poll /health and /load every S seconds (default: {HealthPolicy.interval_s})",
    ),
    Flag(
        "--health-timeout", default=HealthPolicy.timeout_s, type=float, metavar="S",
        help=f"per poll (default: {HealthPolicy.timeout_s})",
    ),
    Flag(
        "--down-after", default=HealthPolicy.failures_to_down, type=int, metavar="N",
        help="consecutive failures that mark a worker down "
        f"(default: {HealthPolicy.failures_to_down})",
    ),
    Flag(
        "--up-after", default=HealthPolicy.successes_to_up, type=int, metavar="N",
        help="consecutive successes that mark it up again "
        f"(default: {HealthPolicy.successes_to_up})",
    ),
    Flag(
        "--max-attempts", default=RetryPolicy.max_attempts, type=int, metavar="N",
        help=f"tries per hop before the client saw a byte (default: {RetryPolicy.max_attempts})",
    ),
    Flag(
        "--retry-backoff", default=RetryPolicy.backoff_s, type=float, metavar="S",
        help=f"first retry delay, doubling after (default: {RetryPolicy.backoff_s})",
    ),
    Flag(
        "--connect-timeout", default=Timeouts.connect_s, type=float, metavar="S",
        help=f"per hop (default: {Timeouts.connect_s})",
    ),
    Flag(
        "--first-byte-timeout", default=Timeouts.first_byte_s, type=float, metavar="S",
        help="per hop, until the worker's response headers, and again until a stream's first "
        "event (a request's wait in the worker's queue); a non-streamed reply sends its headers "
        f"at its end (default: {Timeouts.first_byte_s})",
    ),
))

ROUTE_SECURITY_FLAGS = FlagTable("cluster secret and control plane", (
    Flag(
        "--cluster-secret", metavar="SECRET",
        help="the secret the workers share (the same --cluster-secret or env TANDEM_CLUSTER_SECRET): "
        "every request to a worker is signed with it, and prefill/decode splits and stream migration "
        "need it (default: env TANDEM_CLUSTER_SECRET)",
    ),
    Flag(
        "--admin-key", metavar="KEY",
        help="bearer token for POST /workers/reload, /workers/ID/drain and /resume, and, once keys "
        "are on, for /metrics and /workers (default: env TANDEM_ADMIN_KEY, else the "
        "cluster secret)",
    ),
    Flag(
        "--public-metrics", switch=True,
        help="keep /metrics, /workers and /openapi.json open to anyone even with "
        "--api-keys or --admin-key (they show traffic and workers, never prompts)",
    ),
))


def add_route_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "route",
        help="router in front of prefill / decode workers",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ROUTE_WORKER_FLAGS.add_to(parser)
    ROUTE_SERVER_FLAGS.add_to(parser)
    ROUTING_FLAGS.add_to(parser)
    HEALTH_FLAGS.add_to(parser)
    RESILIENCE_FLAGS.add_to(parser)
    REQUEST_LIMIT_FLAGS.add_to(parser)
    POLICY_FLAGS.add_to(parser)
    ACCOUNTING_FLAGS.add_to(parser)
    ROUTE_SECURITY_FLAGS.add_to(parser)
    Command(cmd_route, check_route).install(parser)


def router_config(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        host=args.host,
        port=args.port,
        workers=specs_from_lists(args.prefill, args.decode, args.worker),
        config_file=args.config,
        discover=tuple(args.discover),
        discover_interval_s=args.discover_interval,
        tokenizer=args.tokenizer,
        pd_min_prompt_tokens=args.pd_min_prompt_tokens,
        health=HealthPolicy(
            args.health_interval, args.health_timeout, args.down_after, args.up_after
        ),
        timeouts=Timeouts(args.connect_timeout, args.first_byte_timeout, args.idle_timeout),
        retry=RetryPolicy(
            args.max_attempts,
            args.retry_backoff,
            budget_ratio=args.retry_budget,
            budget_min_per_s=args.retry_budget_min,
        ),
        breaker=breaker_policy(args),
        admission=admission_policy(args),
        limits=request_limits(args),
        shutdown_timeout_s=args.shutdown_timeout,
        scoring=ScoringConfig(decode_sequence_weight=args.decode_sequence_weight),
        policy=policy_config(args),
        accounting=accounting_config(args),
        migration_limit=args.migration_limit,
        shared_prefix_cache=args.shared_prefix_cache,
        cluster_secret=secret_from_env(args.cluster_secret),
        admin_key=admin_key_from_env(args.admin_key),
        public_metrics=args.public_metrics,
        install_sighup=True,
        log_level=args.log_level.lower(),
        access_log=args.access_log,
        response_store=args.response_store,
    )


def check_route(args: argparse.Namespace) -> RouterConfig:
    """The router's config, built and checked before anything starts: workers given, the
    worker file readable, the secret there when prefill workers need it, and the price, key
    and ledger files usable."""
    config = router_config(args)
    if not config.workers and config.config_file is None and not config.discover:
        raise ValueError("give workers with --prefill/--decode/--worker URL, --config FILE or "
                         "--discover ROLE=HOST:PORT")
    if config.config_file is not None and not config.config_file.is_file():
        raise FileNotFoundError(f"worker file not found: {config.config_file}")
    specs = all_worker_specs(config)  # a broken file is a clear error now, not a failed start-up
    if config.cluster_secret is None and any(spec.role == "prefill" for spec in specs):
        raise ValueError(
            "prefill workers need the cluster secret (--cluster-secret or env "
            f"{CLUSTER_SECRET_ENV}, the same as the workers'): the router hands the KV handoff to "
            "decode workers in signed requests only"
        )
    check_accounting(config.accounting)  # so are a bad price or key file, or ledger path
    check_store_url(config.response_store)
    return config


def cmd_route(args: argparse.Namespace) -> int:
    config = check_route(args)
    from tandem.router.http.app import run_router

    # One line per poll would drown the router's own log lines.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    run_router(config)
    return 0
