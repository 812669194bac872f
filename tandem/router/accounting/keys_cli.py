"""`tandem keys add|list|revoke`: the router's API key file, holding salted hashes only.

`add` prints the new key once (it is stored nowhere else); give the file to the router with
`tandem route --api-keys FILE` (or `tandem up --api-keys FILE`). A running router picks up
changes within a second.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from tandem.flags.table import Command, Flag, FlagTable
from tandem.router.accounting.keys_store import KeyLimits, new_key, read_store, write_store

DEFAULT_KEY_FILE = Path("tandem-keys.json")


# `add`: the key's owner and its own limits (KeyLimits; None: the router's flag).
KEY_ADD_FLAGS = FlagTable(None, (
    Flag("identity", help="who the key belongs to (the usage ledger's identity)"),
    Flag(
        "--rpm", type=int, metavar="N",
        help="requests per minute for this key (default: the router's --rate-limit-rpm)",
    ),
    Flag(
        "--tpm", type=int, metavar="N",
        help="tokens (prompt + completion) per minute (default: --rate-limit-tpm)",
    ),
    Flag(
        "--tokens-per-day", type=int, metavar="N",
        help="daily token quota of the identity, from the usage ledger "
        "(default: --quota-tokens-per-day)",
    ),
))
KEY_REVOKE_FLAGS = FlagTable(None, (Flag("target", metavar="ID|IDENTITY"),))
# Every action's key file.
KEY_FILE_FLAGS = FlagTable(None, (
    Flag(
        "--file", default=DEFAULT_KEY_FILE, type=Path, metavar="FILE",
        help=f"the key file (default: ./{DEFAULT_KEY_FILE})",
    ),
))


def add_keys_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "keys",
        help="add, list or revoke the router's API keys (stored as salted hashes)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="keys_action", required=True, metavar="ACTION")
    add = actions.add_parser("add", help="create a key for IDENTITY and print it once")
    KEY_ADD_FLAGS.add_to(add)
    listing = actions.add_parser("list", help="the keys: id, identity, created, revoked, limits")
    revoke = actions.add_parser("revoke", help="revoke a key by its id (or every key of an identity)")
    KEY_REVOKE_FLAGS.add_to(revoke)
    for sub in (add, listing, revoke):
        KEY_FILE_FLAGS.add_to(sub)
    Command(cmd_keys).install(parser)


def cmd_keys(args: argparse.Namespace) -> int:
    keys = read_store(args.file)
    if args.keys_action == "add":
        limits = KeyLimits(args.rpm, args.tpm, args.tokens_per_day)
        key, entry = new_key(args.identity, limits, {k.id for k in keys})
        write_store(args.file, [*keys, entry])
        print(f"added key {entry.id} for {entry.identity} to {args.file}")
        print("the key (shown only now; the file keeps a salted hash):")
        print(key)
        return 0
    if args.keys_action == "list":
        if not keys:
            print(f"no keys in {args.file}")
            return 0
        print(f"{'ID':<10} {'IDENTITY':<20} {'CREATED':<27} {'REVOKED':<27} LIMITS")
        for k in keys:
            limits = ", ".join(f"{n}={v}" for n, v in dataclasses.asdict(k.limits).items()
                               if v is not None) or "defaults"
            print(f"{k.id:<10} {k.identity:<20} {k.created:<27} {k.revoked or '-':<27} {limits}")
        return 0
    targets = [k for k in keys if args.target in (k.id, k.identity) and not k.revoked]
    if not targets:
        raise ValueError(f"no live key with id or identity {args.target!r} in {args.file}")
    from datetime import UTC, datetime

    when = datetime.now(UTC).isoformat(timespec="seconds")
    revoked = {k.id for k in targets}
    write_store(args.file, [dataclasses.replace(k, revoked=when) if k.id in revoked else k
                            for k in keys])
    for k in targets:
        print(f"revoked key {k.id} of {k.identity}")
    return 0
