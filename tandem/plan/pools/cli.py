"""`tandem plan profile` and `tandem plan pools`: measure step costs, then size the pools."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from tandem.flags.table import Flag, FlagTable
from tandem.plan.pools.costs import CostModel
from tandem.plan.pools.search import Slo, recommendation, search
from tandem.plan.pools.simulator import EngineLimits
from tandem.plan.pools.traffic import TrafficMix

logger = logging.getLogger(__name__)

_PROFILE_DESCRIPTION = """\
Measure what an engine step costs on this machine (prompt chunks of several sizes after
several cached contexts, decode steps at several batch sizes and contexts, the KV handoff,
an HTTP hop) and write a cost model that `tandem plan pools` and `tandem bench plan` read.
Run it with the flags each worker will get (--threads is a worker's share of the cores).

example:
  tandem plan profile --threads 1 --out profile.json
"""

_POOLS_DESCRIPTION = """\
Simulate a cluster serving a traffic mix, for every layout of up to --max-workers workers
(colocated, or a prefill pool and a decode pool), and recommend the smallest that meets the
TTFT and time-per-output-token SLOs at p90, and whether to disaggregate at all. The
simulator models tandem route's kv_aware placement, chunked prefill, the prefix cache and
the KV handoff, with step costs from `tandem plan profile`.

examples:
  tandem plan pools --profile profile.json --rate 0.5 --turns 3-8 --system 1500 \\
      --input 50-200 --output 16-32 --ttft-p90 2 --tpot-p90 0.08
  tandem plan pools --profile profile.json --rate 1 --input 128 --output 128-256 --max-workers 4
"""


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected N or LOW-HIGH, got {text!r}") from exc
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


PROFILE_FLAGS = FlagTable(None, (
    Flag("model", nargs="?", help="model (default: smollm2-135m)"),
    Flag(
        "--out", default=Path("tandem-profile.json"), type=Path,
        help="where to write the cost model (default: tandem-profile.json)",
    ),
    Flag("--threads", type=int, help="engine threads, as a worker gets them"),
    Flag("--dtype", default="auto", help="weight dtype (default: auto)"),
    Flag(
        "--max-num-batched-tokens", default=2048, type=int,
        help="the workers' step budget (default: 2048)",
    ),
    Flag("--repeats", default=3, type=int, help="measurements per grid point (default: 3)"),
    Flag(
        "--transfer-gbps", type=float,
        help="KV handoff over a network of this rate (default: a same-host memory copy)",
    ),
))
POOLS_INPUT_FLAGS = FlagTable(None, (
    Flag("--profile", type=Path, required=True, help="a cost model from `tandem plan profile`"),
))
POOLS_TRAFFIC_FLAGS = FlagTable("traffic", (
    Flag("--rate", type=float, required=True, help="sessions arriving per second (Poisson)"),
    Flag("--sessions", default=64, type=int, help="sessions to simulate (default: 64)"),
    Flag(
        "--turns", default=(1, 1), type=_range,
        help="turns per session, N or LOW-HIGH (default: 1)",
    ),
    Flag("--system", default=0, type=int, help="shared system-prompt tokens (default: 0)"),
    Flag(
        "--input", default=(512, 512), type=_range,
        help="new input tokens per turn, N or LOW-HIGH (default: 512)",
    ),
    Flag(
        "--output", default=(128, 128), type=_range,
        help="output tokens per turn, N or LOW-HIGH (default: 128)",
    ),
    Flag("--seed", default=0, type=int),
))
POOLS_GOALS_FLAGS = FlagTable("goals and limits", (
    Flag("--ttft-p90", default=2.0, type=float, help="TTFT p90 goal, seconds (default: 2)"),
    Flag(
        "--tpot-p90", default=0.1, type=float,
        help="time per output token p90 goal, seconds (default: 0.1)",
    ),
    Flag("--max-workers", default=4, type=int, help="workers to try up to (default: 4)"),
    Flag("--max-num-batched-tokens", default=2048, type=int),
    Flag("--max-num-seqs", default=128, type=int),
    Flag(
        "--pd-min-prompt-tokens", default=256, type=int,
        help="the router's split threshold (default: 256)",
    ),
))
POOLS_OUTPUT_FLAGS = FlagTable(None, (
    Flag("--json", switch=True, help="print every layout's figures as JSON"),
))


def add_pools_parsers(commands: argparse._SubParsersAction) -> None:
    profile = commands.add_parser("profile", help="measure engine step costs on this machine (loads the model)",
                                  description=_PROFILE_DESCRIPTION,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    PROFILE_FLAGS.add_to(profile)
    profile.set_defaults(handler=cmd_plan_profile)

    pools = commands.add_parser("pools", help="recommend prefill / decode pool sizes for a traffic mix",
                                description=_POOLS_DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    POOLS_INPUT_FLAGS.add_to(pools)
    POOLS_TRAFFIC_FLAGS.add_to(pools)
    POOLS_GOALS_FLAGS.add_to(pools)
    POOLS_OUTPUT_FLAGS.add_to(pools)
    pools.set_defaults(handler=cmd_plan_pools)


def cmd_plan_profile(args: argparse.Namespace) -> int:
    from tandem.plan.pools.profile import ProfileSettings, format_profile, measure_profile

    settings = ProfileSettings(model=args.model, dtype=args.dtype, threads=args.threads,
                               max_num_batched_tokens=args.max_num_batched_tokens, repeats=args.repeats,
                               transfer_gbps=args.transfer_gbps)
    model, measurements = measure_profile(settings, progress=lambda line: logger.info("%s", line))
    model.save(args.out)
    print(format_profile(model, measurements))
    print(f"\nwrote {args.out}")
    return 0


def cmd_plan_pools(args: argparse.Namespace) -> int:
    costs = CostModel.load(args.profile)
    mix = TrafficMix(rate=args.rate, num_sessions=args.sessions, turns_min=args.turns[0], turns_max=args.turns[1],
                     system_tokens=args.system, input_min=args.input[0], input_max=args.input[1],
                     output_min=args.output[0], output_max=args.output[1], seed=args.seed)
    slo = Slo(args.ttft_p90, args.tpot_p90)
    limits = EngineLimits(args.max_num_batched_tokens, args.max_num_seqs, costs.block_size)
    ranked = search(mix.sample(), costs, slo, args.max_workers, limits, args.pd_min_prompt_tokens)
    if args.json:
        print(json.dumps([{"layout": c.layout.describe(), "workers": c.layout.workers, "meets": c.meets,
                           **c.result.summary(), "utilisation": c.result.utilisation()} for c in ranked], indent=2))
        return 0
    print(f"profile: {costs.meta.get('model', '?')} on {costs.meta.get('machine', {}).get('cpu', '?')}, "
          f"threads {costs.meta.get('threads')}")
    print(f"traffic: {args.sessions} sessions at {args.rate:g}/s, {args.turns[0]}-{args.turns[1]} turns, "
          f"system {args.system}, input {args.input[0]}-{args.input[1]}, output {args.output[0]}-{args.output[1]}")
    print(f"SLOs: TTFT p90 <= {slo.ttft_p90_s:g} s, TPOT p90 <= {slo.tpot_p90_s * 1e3:g} ms\n")
    print(f"{'layout':<16} {'workers':>7} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} {'TPOT p90':>9} "
          f"{'out tok/s':>9} {'cached':>7} {'busiest':>7}  SLOs")
    for c in sorted(ranked, key=lambda c: (c.layout.workers, c.layout.disaggregated, c.layout.prefill)):
        r = c.result
        print(f"{c.layout.describe():<16} {c.layout.workers:>7} {r.ttft(50):>8.3f}s {r.ttft(90):>8.3f}s "
              f"{r.tpot(50) * 1e3:>7.1f}ms {r.tpot(90) * 1e3:>7.1f}ms {r.output_tokens_per_s:>9.1f} "
              f"{r.cached_ratio:>6.0%} {max(r.utilisation().values()):>6.0%}  {'met' if c.meets else '-'}")
    print("\n" + recommendation(ranked))
    return 0
