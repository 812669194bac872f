"""`tandem bench offline` (placeholder until the benchmark lands)."""

from __future__ import annotations

import argparse


def add_offline_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("offline", help="offline throughput / latency vs peers")
    parser.set_defaults(handler=lambda args: 0)
