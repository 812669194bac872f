"""The request-limit flags (`--max-request-bytes`, `--body-timeout`, `--max-messages`,
`--max-tools`), shared by `tandem serve`, `tandem route` and `tandem up`, and the
`RequestLimits` they build for the HTTP edge (tandem/edge/limits.py), which knows nothing of
flags."""

from __future__ import annotations

import argparse

from tandem.config import RequestLimits, parse_memory_size
from tandem.flags.table import Flag, FlagTable

_DEFAULTS = RequestLimits()


REQUEST_LIMIT_FLAGS = FlagTable("request limits", (
    Flag("--max-request-bytes", "larger request bodies get 413, e.g. 16MiB (default: 16MiB)",
         str(_DEFAULTS.max_body_bytes), metavar="SIZE"),
    Flag("--body-timeout", "a request body not fully sent after S seconds gets 408 "
         f"(default: {_DEFAULTS.body_timeout_s:g})", _DEFAULTS.body_timeout_s, type=float, metavar="S"),
    Flag("--max-messages", f"messages per chat request (default: {_DEFAULTS.max_messages})",
         _DEFAULTS.max_messages, type=int, metavar="N"),
    Flag("--max-tools", f"tool definitions per request (default: {_DEFAULTS.max_tools})",
         _DEFAULTS.max_tools, type=int, metavar="N"),
))


def add_request_limit_args(parser: argparse.ArgumentParser) -> None:
    REQUEST_LIMIT_FLAGS.add_to(parser)


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(parse_memory_size(args.max_request_bytes), args.body_timeout,
                         args.max_messages, args.max_tools)


def request_limit_argv(args: argparse.Namespace) -> list[str]:
    request_limits(args)
    return REQUEST_LIMIT_FLAGS.argv(args, changed_only=False)
