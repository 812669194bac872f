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

This module is the command itself: its parser and `cmd_up`. Its flags are `up_flags`, what
runs where is `cluster_plan` (pure), and the running processes are `cluster`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import signal
import threading
from pathlib import Path

from tandem.flags import engine as flags
from tandem.flags.table import Command
from tandem.launch.cluster import (
    Cluster,
    _check_port_free,
    start_local_store,
    write_secret,
)
from tandem.launch.cluster_plan import cluster_secret, plan_cluster
from tandem.launch.up_flags import add_up_flags, check_up
from tandem.platform.ports import free_port


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
    add_up_flags(parser)
    Command(cmd_up, check_up).install(parser)


def cmd_up(args: argparse.Namespace) -> int:
    flags.settle_device(args)  # --dtype auto -> this host's dtype (the CLI did it; direct callers may not)
    from tandem.loader.resolve import resolve_model
    from tandem.tokenization.tiktoken_tokenizer import has_tiktoken_model

    check_up(args)  # the CLI did it at parse time; direct callers may not
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    _check_port_free(args.host, args.port)
    if args.netns:
        from tandem.launch import netns

        reason = netns.available()
        if reason:
            raise ValueError(f"--netns: {reason}")
    # Resolve (and, for a GGUF, convert) once here rather than in N workers at once; the
    # router counts prompt tokens with the same tokenizer.json.
    resolved = resolve_model(args.model, args.dtype)
    tokenizer_dir = (resolved.hf_dir if (resolved.hf_dir / "tokenizer.json").is_file()
                     or has_tiktoken_model(resolved.hf_dir) else None)
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
