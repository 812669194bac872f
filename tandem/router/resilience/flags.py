"""The fault-handling flag table, shared by `tandem route` and `tandem up` (which offers part of
it and passes that on), and the policies built from it."""

from __future__ import annotations

import argparse

from tandem.flags.table import Flag, FlagTable
from tandem.router.config import AdmissionPolicy, BreakerPolicy, RetryPolicy, RouterConfig, Timeouts

_DEFAULTS = RouterConfig()
_BREAKER = BreakerPolicy()
_RETRY = RetryPolicy()
_ADMISSION = AdmissionPolicy()


RESILIENCE_FLAGS = FlagTable("faults", (
    Flag(
        "--migration-limit",
        type=int,
        default=_DEFAULTS.migration_limit,
        metavar="N",
        help="when a worker fails mid-stream, continue the stream on another worker (the "
        "prompt plus the tokens sent so far), at most N times per request; 0 turns it off "
        f"(default: {_DEFAULTS.migration_limit})",
    ),
    Flag(
        "--max-in-flight",
        type=int,
        default=_ADMISSION.max_in_flight,
        metavar="N",
        help="requests the router serves at once; more wait in its queue (0: no bound) "
        f"(default: {_ADMISSION.max_in_flight})",
    ),
    Flag(
        "--max-queue",
        type=int,
        default=_ADMISSION.max_queue,
        metavar="N",
        help="requests that may wait for a slot; beyond, 429 with Retry-After "
        f"(default: {_ADMISSION.max_queue})",
    ),
    Flag(
        "--queue-timeout",
        type=float,
        default=_ADMISSION.queue_timeout_s,
        metavar="S",
        help=f"a request that waited S seconds for a slot gets a 408 "
        f"(default: {_ADMISSION.queue_timeout_s:g})",
    ),
    Flag(
        "--idle-timeout",
        type=float,
        default=Timeouts.idle_s,
        metavar="S",
        help="a stream silent for S seconds after its first token is broken (and moved, see "
        "--migration-limit); a worker whose health checks fail breaks its streams at once "
        f"(default: {Timeouts.idle_s:g})",
    ),
    Flag(
        "--shutdown-timeout",
        type=float,
        default=_DEFAULTS.shutdown_timeout_s,
        metavar="S",
        help="SIGTERM drains: new requests get a retryable 503 and /health fails while the "
        "requests in flight finish, for up to S seconds; a second SIGTERM or Ctrl-C stops at "
        f"once (default: {_DEFAULTS.shutdown_timeout_s:g})",
    ),
    Flag(
        "--breaker-failures",
        type=int,
        default=_BREAKER.failures,
        metavar="N",
        help="a worker's circuit breaker opens after N of its own failures (no connection, "
        "a timeout, a 5xx other than a busy 503, a broken stream) within --breaker-window; "
        f"busy answers (429) and clients' errors never count (default: {_BREAKER.failures})",
    ),
    Flag(
        "--breaker-window",
        type=float,
        default=_BREAKER.window_s,
        metavar="S",
        help=f"seconds over which --breaker-failures are counted (default: {_BREAKER.window_s:g})",
    ),
    Flag(
        "--breaker-cooldown",
        type=float,
        default=_BREAKER.cooldown_s,
        metavar="S",
        help="an open breaker sends the worker nothing for S seconds, then one trial request; "
        f"each failed trial doubles S, up to {_BREAKER.max_cooldown_s:g} s "
        f"(default: {_BREAKER.cooldown_s:g})",
    ),
    Flag(
        "--retry-budget",
        type=float,
        default=_RETRY.budget_ratio,
        metavar="R",
        help="retries may add at most R x the requests of the last "
        f"{_RETRY.budget_window_s:g} s, so that retries cannot multiply an overload "
        f"(default: {_RETRY.budget_ratio:g})",
    ),
    Flag(
        "--retry-budget-min",
        type=float,
        default=_RETRY.budget_min_per_s,
        metavar="N",
        help="retries per second allowed whatever the ratio, for quiet routers "
        f"(default: {_RETRY.budget_min_per_s:g})",
    ),
))
# What `tandem up` offers and passes on: the migration limit and the admission bounds; the
# breaker and retry-budget tuning are `tandem route`'s alone.
UP_RESILIENCE_FLAGS = RESILIENCE_FLAGS.subset({
    "--migration-limit", "--max-in-flight", "--max-queue", "--queue-timeout", "--idle-timeout",
})


def breaker_policy(args: argparse.Namespace) -> BreakerPolicy:
    cooldown = args.breaker_cooldown
    return BreakerPolicy(
        failures=args.breaker_failures,
        window_s=args.breaker_window,
        cooldown_s=cooldown,
        max_cooldown_s=max(_BREAKER.max_cooldown_s, cooldown),
    )


def admission_policy(args: argparse.Namespace) -> AdmissionPolicy:
    return AdmissionPolicy(args.max_in_flight, args.max_queue, args.queue_timeout)


def resilience_argv(args: argparse.Namespace) -> list[str]:
    """The flags `tandem up` passes on to its `tandem route`, checked here first."""
    if args.migration_limit < 0:
        raise ValueError(f"--migration-limit must be >= 0, got {args.migration_limit}")
    admission_policy(args)
    return UP_RESILIENCE_FLAGS.argv(args, changed_only=False)
