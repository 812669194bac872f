"""`tandem bench overhead`'s flags, apart from the measuring code.

`tandem.bench.overhead` also runs as a file inside a baseline checkout (an older tree that may
lack the flag tables), so it imports nothing of tandem at module level; the command's tables
live here instead.
"""

from __future__ import annotations

import argparse

from tandem.bench.overhead import check_overhead, run_overhead
from tandem.flags.table import Command, Flag, FlagTable

# What one measurement runs: the measuring process takes the same four (see measure_parser).
OVERHEAD_MEASURE_FLAGS = FlagTable(None, (
    Flag("--model", help="model (default: smollm2-135m)"),
    Flag("--batch", default=1, type=int, help="sequences per step (default: 1)"),
    Flag("--steps", default=200, type=int, help="decode steps timed (default: 200)"),
    Flag("--threads", type=int, help="torch threads (default: torch's)"),
))
# What is compared, how often, and where the figures go.
OVERHEAD_FLAGS = FlagTable(None, (
    Flag(
        "--baseline", metavar="PATH",
        help="another tandem checkout to measure in the same run (e.g. a git worktree)",
    ),
    Flag("--repeats", default=3, type=int, help="runs per engine, alternating (default: 3)"),
    Flag("--output", metavar="FILE", help="also write the figures as JSON"),
))


def add_overhead_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "overhead", help="per-step engine overhead (step time minus the model's own time)",
        description="Time engine steps at a fixed batch and split them into the model's time (forward "
                    "and LM head) and everything else; optionally beside another tandem checkout.")
    OVERHEAD_MEASURE_FLAGS.add_to(parser)
    OVERHEAD_FLAGS.add_to(parser)
    Command(run_overhead, check_overhead).install(parser)
