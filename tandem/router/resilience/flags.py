"""The fault-handling flags, shared by `tandem route` and `tandem up` (which passes them on)."""

from __future__ import annotations

import argparse

from tandem.router.config import RouterConfig

_DEFAULTS = RouterConfig()


def add_resilience_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("faults")
    group.add_argument(
        "--migration-limit",
        type=int,
        default=_DEFAULTS.migration_limit,
        metavar="N",
        help="when a worker fails mid-stream, continue the stream on another worker (the "
        "prompt plus the tokens sent so far), at most N times per request; 0 turns it off "
        f"(default: {_DEFAULTS.migration_limit})",
    )


def resilience_argv(args: argparse.Namespace) -> list[str]:
    """The flags `tandem up` passes on to its `tandem route`."""
    if args.migration_limit < 0:
        raise ValueError(f"--migration-limit must be >= 0, got {args.migration_limit}")
    return ["--migration-limit", str(args.migration_limit)]
