"""`tandem plan profile` and `tandem plan pools`: measure step costs, then size the pools."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

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


def add_pools_parsers(commands: argparse._SubParsersAction) -> None:
    profile = commands.add_parser("profile", help="measure engine step costs on this machine (loads the model)",
                                  description=_PROFILE_DESCRIPTION,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    profile.add_argument("model", nargs="?", default=None, help="model (default: smollm2-135m)")
    profile.add_argument("--out", type=Path, default=Path("tandem-profile.json"),
                         help="where to write the cost model (default: tandem-profile.json)")
    profile.add_argument("--threads", type=int, default=None, help="engine threads, as a worker gets them")
    profile.add_argument("--dtype", default="auto", help="weight dtype (default: auto)")
    profile.add_argument("--max-num-batched-tokens", type=int, default=2048,
                         help="the workers' step budget (default: 2048)")
    profile.add_argument("--repeats", type=int, default=3, help="measurements per grid point (default: 3)")
    profile.add_argument("--transfer-gbps", type=float, default=None,
                         help="KV handoff over a network of this rate (default: a same-host memory copy)")
    profile.set_defaults(handler=cmd_plan_profile)

    pools = commands.add_parser("pools", help="recommend prefill / decode pool sizes for a traffic mix",
                                description=_POOLS_DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    pools.add_argument("--profile", type=Path, required=True, help="a cost model from `tandem plan profile`")
    traffic = pools.add_argument_group("traffic")
    traffic.add_argument("--rate", type=float, required=True, help="sessions arriving per second (Poisson)")
    traffic.add_argument("--sessions", type=int, default=64, help="sessions to simulate (default: 64)")
    traffic.add_argument("--turns", type=_range, default=(1, 1), help="turns per session, N or LOW-HIGH (default: 1)")
    traffic.add_argument("--system", type=int, default=0, help="shared system-prompt tokens (default: 0)")
    traffic.add_argument("--input", type=_range, default=(512, 512),
                         help="new input tokens per turn, N or LOW-HIGH (default: 512)")
    traffic.add_argument("--output", type=_range, default=(128, 128),
                         help="output tokens per turn, N or LOW-HIGH (default: 128)")
    traffic.add_argument("--seed", type=int, default=0)
    goals = pools.add_argument_group("goals and limits")
    goals.add_argument("--ttft-p90", type=float, default=2.0, help="TTFT p90 goal, seconds (default: 2)")
    goals.add_argument("--tpot-p90", type=float, default=0.1,
                       help="time per output token p90 goal, seconds (default: 0.1)")
    goals.add_argument("--max-workers", type=int, default=4, help="workers to try up to (default: 4)")
    goals.add_argument("--max-num-batched-tokens", type=int, default=2048)
    goals.add_argument("--max-num-seqs", type=int, default=128)
    goals.add_argument("--pd-min-prompt-tokens", type=int, default=256,
                       help="the router's split threshold (default: 256)")
    pools.add_argument("--json", action="store_true", help="print every layout's figures as JSON")
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
    limits = EngineLimits(args.max_num_batched_tokens, args.max_num_seqs)
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
