"""The pricing / ledger / API-key flags, shared by `tandem route` and `tandem up`.

`tandem up` takes the same flags and hands them to the router it starts (`accounting_argv`),
so both commands document and default them the same way.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
from pathlib import Path

from tandem.flags.table import Flag, FlagTable
from tandem.router.accounting.accounting import load_keys
from tandem.router.accounting.ledger import connect
from tandem.router.accounting.pricing import read_price_file
from tandem.router.config import AccountingConfig

DEFAULT_LEDGER = Path("tandem-usage.sqlite3")
WORKER_KEY_ENV = "TANDEM_WORKER_API_KEY"


ACCOUNTING_FLAGS = FlagTable("pricing, usage ledger and API keys", (
    Flag(
        "--prices", type=Path, metavar="FILE",
        help='JSON/YAML {"MODEL": {"input": USD, "cached_input": USD, "output": USD}} per 1M '
        'tokens; "*" for other models (default: every model free, costs reported as 0)',
    ),
    Flag(
        "--ledger", type=Path, default=DEFAULT_LEDGER, metavar="PATH",
        help=f"SQLite usage ledger, one row per request (default: ./{DEFAULT_LEDGER})",
    ),
    Flag("--no-ledger", help="keep no usage ledger", switch=True),
    Flag(
        "--api-keys", type=Path, metavar="FILE",
        help="require 'Authorization: Bearer KEY' on /v1/*: a file `tandem keys add` wrote "
        "(salted hashes and per-key limits), or JSON/YAML {KEY: IDENTITY} or lines "
        "'KEY IDENTITY'; re-read when it changes (default: no keys)",
    ),
    *(
        Flag(
            flag, type=int, metavar="N",
            help=f"{what}, where the key file sets none; beyond it, 429 with Retry-After "
            "(default: unlimited)",
        )
        for flag, what in (
            ("--rate-limit-rpm", "requests per minute per API key"),
            ("--rate-limit-tpm", "tokens (prompt + completion) per minute per API key"),
            ("--quota-tokens-per-day", "tokens per identity per day (UTC), from the usage ledger"),
        )
    ),
    Flag(
        "--shared-prefix-cache", switch=True,
        help="with --api-keys, let every identity's requests share cached prompt KV; by "
        "default each identity gets its own cache_salt, because a shared cache's faster "
        "answers tell one tenant what another tenant's prompts began with",
    ),
    Flag(
        "--usage-admin", action="append", default=[], metavar="IDENTITY",
        help="an identity that may read everyone's GET /v1/usage (repeatable)",
    ),
    Flag(
        "--worker-api-key", metavar="KEY",
        help="send workers 'Authorization: Bearer KEY' (default: env "
        f"{WORKER_KEY_ENV}; without it the client's header passes through unless "
        "--api-keys is on)",
    ),
))
# `tandem up` starts its workers itself and passes them no key: everything but --worker-api-key.
UP_ACCOUNTING_FLAGS = ACCOUNTING_FLAGS.without({"--worker-api-key"})


def accounting_config(args: argparse.Namespace) -> AccountingConfig:
    worker_key = getattr(args, "worker_api_key", None) or os.environ.get(WORKER_KEY_ENV)
    return AccountingConfig(
        prices_file=args.prices,
        ledger_path=None if args.no_ledger else args.ledger,
        api_keys_file=args.api_keys,
        worker_api_key=worker_key or None,
        usage_admins=tuple(args.usage_admin),
        rate_limit_rpm=args.rate_limit_rpm,
        rate_limit_tpm=args.rate_limit_tpm,
        quota_tokens_per_day=args.quota_tokens_per_day,
    )


def accounting_argv(args: argparse.Namespace) -> list[str]:
    """The flags again, for the router `tandem up` starts (paths as the user gave them: the
    router runs in the same working directory)."""
    argv: list[str] = []
    if args.prices is not None:
        argv += ["--prices", str(args.prices)]
    argv += ["--no-ledger"] if args.no_ledger else ["--ledger", str(args.ledger)]
    if args.api_keys is not None:
        argv += ["--api-keys", str(args.api_keys)]
    for identity in args.usage_admin:
        argv += ["--usage-admin", identity]
    if args.shared_prefix_cache:
        argv += ["--shared-prefix-cache"]
    for name in ("rate_limit_rpm", "rate_limit_tpm", "quota_tokens_per_day"):
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def check_accounting(config: AccountingConfig) -> None:
    """Fail before start-up on a bad price or key file or an unusable ledger path."""
    if config.prices_file is not None:
        read_price_file(config.prices_file)
    load_keys(config)
    for flag, value in (
        ("--rate-limit-rpm", config.rate_limit_rpm),
        ("--rate-limit-tpm", config.rate_limit_tpm),
        ("--quota-tokens-per-day", config.quota_tokens_per_day),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if config.ledger_path is not None:
        try:
            config.ledger_path.parent.mkdir(parents=True, exist_ok=True)
            connect(config.ledger_path).close()
        except (OSError, sqlite3.Error) as exc:
            raise ValueError(f"cannot open the usage ledger {config.ledger_path}: {exc}") from exc
