"""The routing-policy flag table, shared by `tandem route` and `tandem up` (which offers part of
it and passes that on), and the PolicyConfig built from it."""

from __future__ import annotations

import argparse

from tandem.flags.table import Flag, FlagTable
from tandem.router.config import FALLBACK_TIER_CREDITS, POLICIES, PolicyConfig

_DEFAULTS = PolicyConfig()


_CREDIT_FLAGS = tuple(
    Flag(
        f"--kv-credit-{medium}", type=float, metavar="C",
        help=f"kv_aware: a cached prompt block in {where} counts as C of a block "
        "cached on the device (1.0). It still has to be loaded, so C is the fraction of "
        "its prefill the hit saves; 0 ignores that tier when routing (default: measured "
        "per worker from its loads and prefill rate; "
        f"{FALLBACK_TIER_CREDITS[medium]} until it has measured them)",
    )
    for medium, where in (
        ("cpu", "the worker's CPU-memory tier"),
        ("disk", "the worker's local disk tier"),
        ("cluster", "the cluster store (which every worker reads)"),
    )
)

POLICY_FLAGS = FlagTable("routing policy", (
    Flag(
        "--policy", choices=POLICIES, default=_DEFAULTS.name,
        help="how the first hop's worker is chosen: kv_aware (the worker holding the "
        "longest cached prefix of the prompt, weighed against its load), least_tokens "
        "(fewest queued tokens), session (affinity ring only), round_robin. An affinity key "
        f"decides first under every policy (default: {_DEFAULTS.name})",
    ),
    Flag(
        "--affinity-header", default=_DEFAULTS.affinity_header, metavar="NAME",
        help="a request header read as the session affinity key when x-session-affinity is "
        "absent; the body's `user` field comes last (default: none)",
    ),
    Flag(
        "--balance-factor", type=float, default=_DEFAULTS.balance_factor, metavar="C",
        help="bounded loads: a worker with more than ceil(C x average) in-flight requests "
        "passes sessions and kv_aware picks on to the next worker "
        f"(default: {_DEFAULTS.balance_factor})",
    ),
    Flag(
        "--prefill-weight", type=float, default=_DEFAULTS.prefill_weight, metavar="W",
        help="kv_aware cost = W x prefill tokens + decode tokens; higher keeps turns where "
        "their prefix is cached even when that worker is decoding more "
        f"(default: {_DEFAULTS.prefill_weight})",
    ),
    *_CREDIT_FLAGS,
    Flag(
        "--kv-events-interval", type=float, default=_DEFAULTS.kv_events_interval_s, metavar="S",
        help="poll each worker's GET /kv/events every S seconds "
        f"(default: {_DEFAULTS.kv_events_interval_s})",
    ),
    Flag(
        "--tokenize-timeout", type=float, default=_DEFAULTS.tokenize_timeout_s, metavar="S",
        help="kv_aware asks a worker to tokenize the prompt; slower than this, the request "
        f"is routed by load (default: {_DEFAULTS.tokenize_timeout_s})",
    ),
))
# What `tandem up` offers and passes on: the three main flags and the tier credits (it
# starts the tiers); the tuning flags are `tandem route`'s alone.
UP_POLICY_FLAGS = POLICY_FLAGS.without({"--prefill-weight", "--kv-events-interval",
                                        "--tokenize-timeout"})


def policy_config(args: argparse.Namespace) -> PolicyConfig:
    return PolicyConfig(
        name=args.policy,
        affinity_header=args.affinity_header or None,
        balance_factor=args.balance_factor,
        prefill_weight=getattr(args, "prefill_weight", _DEFAULTS.prefill_weight),
        kv_credit_cpu=getattr(args, "kv_credit_cpu", _DEFAULTS.kv_credit_cpu),
        kv_credit_disk=getattr(args, "kv_credit_disk", _DEFAULTS.kv_credit_disk),
        kv_credit_cluster=getattr(args, "kv_credit_cluster", _DEFAULTS.kv_credit_cluster),
        tokenize_timeout_s=getattr(args, "tokenize_timeout", _DEFAULTS.tokenize_timeout_s),
        kv_events_interval_s=getattr(args, "kv_events_interval", _DEFAULTS.kv_events_interval_s),
    )


def policy_argv(args: argparse.Namespace) -> list[str]:
    """The flags `tandem up` passes on to its `tandem route`, checked here first (a bad
    value stops `tandem up` before it starts any worker)."""
    policy_config(args)
    argv = ["--policy", args.policy, "--balance-factor", str(args.balance_factor)]
    if args.affinity_header:
        argv += ["--affinity-header", args.affinity_header]
    return argv + UP_POLICY_FLAGS.subset([f.option for f in _CREDIT_FLAGS]).argv(args)
