"""`tandem bench plan`: the pool planner's predictions beside a real cluster's figures.

For each traffic mix, a real `tandem up` cluster (default: 1 prefill + 1 decode worker,
one thread each) serves the mix as `tandem bench serve` sends it (Poisson session arrivals,
streamed chat or completions, exact output lengths), and the simulator of `tandem plan
pools` runs the same sessions (same turn lengths, same arrival times) with the cost model
from `tandem plan profile`. It prints TTFT and time per output token (p50, p90) measured
and predicted, and how far apart they are; the planner's goal is within 20%.

Two mixes by default: `agentic` (input-heavy: sessions of several turns over a shared
system prompt, short answers) and `output-heavy` (one-turn prompts, long answers).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.bench.load_client import RunResult, TrafficConfig, poisson_arrivals, run_load
from tandem.bench.serve import DEFAULT_MODEL, LaunchedServer
from tandem.bench.serve_workloads import (
    MESSAGE_OVERHEAD_TOKENS,
    ServeWorkload,
    WorkloadConfig,
    build_serve_workload,
    make_sizer,
    warmup_turn,
)
from tandem.flags.table import Command, Flag, FlagTable
from tandem.plan.pools.costs import CostModel
from tandem.plan.pools.simulator import EngineLimits, Layout, SimResult, percentile, simulate
from tandem.plan.pools.traffic import SimSession, SimTurn, SimWorkload
from tandem.platform.ports import free_port

logger = logging.getLogger(__name__)

GOAL = 0.20  # predicted within 20% of measured


@dataclass(frozen=True)
class Mix:
    name: str
    workload: WorkloadConfig
    rate: float  # sessions per second
    description: str


MIXES = {
    "agentic": Mix("agentic", WorkloadConfig(name="agentic", num_sessions=12, turns_min=3, turns_max=5,
                                             prefix_len=1000, user_len_min=50, user_len_max=150,
                                             agentic_output_len=16, max_context=4096),
                   0.12, "input-heavy: sessions of 3-5 turns over a 1000-token system prompt, 16-token answers"),
    "output-heavy": Mix("output-heavy", WorkloadConfig(name="random", num_requests=24, input_len=128,
                                                       output_len=160, range_ratio=0.25),
                        0.3, "one-turn prompts of ~128 tokens, ~160-token answers"),
}
LAYOUTS = {"pd": (Layout(prefill=1, decode=1), ["--prefill-workers", "1", "--decode-workers", "1"]),
           "colocated": (Layout(colocated=2), ["--workers", "2"])}


# The cost model, the cluster it predicts and the mixes sent to it: one group.
PLAN_BENCH_FLAGS = FlagTable(None, (
    Flag("--profile", type=Path, required=True, help="a cost model from `tandem plan profile`"),
    Flag("--model", default=DEFAULT_MODEL, help=f"model (default: {DEFAULT_MODEL})"),
    Flag(
        "--mixes", default="agentic,output-heavy",
        help=f"comma-separated, from {', '.join(MIXES)} (default: both)",
    ),
    Flag(
        "--layout", default="pd", choices=sorted(LAYOUTS),
        help="pd: 1 prefill + 1 decode worker; colocated: 2 workers (default: pd)",
    ),
    Flag("--threads", default=1, type=int, help="threads per worker (default: 1, as profiled)"),
    Flag(
        "--rate-scale", default=1.0, type=float,
        help="multiply each mix's session rate (default: 1)",
    ),
    Flag(
        "--size-scale", default=1.0, type=float,
        help="multiply each mix's session (or request) count, at least 2 (default: 1)",
    ),
    Flag("--seed", default=0, type=int),
    Flag("--kv-cache-memory", default="1GiB", help="per worker (default: 1GiB)"),
    Flag(
        "--out", default=Path("bench-results/plan"), type=Path,
        help="report directory (default: bench-results/plan)",
    ),
))


def add_plan_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="the pool planner's predicted TTFT / TPOT beside a real cluster's",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    PLAN_BENCH_FLAGS.add_to(parser)
    Command(run_plan_bench, check_plan_bench).install(parser)


def parse_mixes(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in MIXES]
    if unknown:
        raise ValueError(f"unknown mix {', '.join(unknown)}; choose from {', '.join(MIXES)}")
    return names


def check_plan_bench(args: argparse.Namespace) -> None:
    """An unknown --mixes name fails at parse time, before the cluster starts."""
    parse_mixes(args.mixes)


def scaled(config: WorkloadConfig, factor: float) -> WorkloadConfig:
    return dataclasses.replace(config, num_sessions=max(2, round(config.num_sessions * factor)),
                               num_requests=max(2, round(config.num_requests * factor)))


def sim_workload(workload: ServeWorkload, rate: float, seed: int) -> SimWorkload:
    """The same sessions as the load client sends: its turn lengths and its arrival times."""
    arrivals = poisson_arrivals(len(workload.sessions), rate, seed)
    sessions = tuple(SimSession(s.session_id, at, tuple(SimTurn(t.prompt_len, t.max_tokens) for t in s.turns))
                     for s, at in zip(workload.sessions, arrivals, strict=True))
    chat = workload.chat_only
    return SimWorkload(sessions, workload.system_len, MESSAGE_OVERHEAD_TOKENS if chat else 0)


def measured_figures(result: RunResult) -> dict[str, float]:
    ok = [r for r in result.records if r.ok and r.ttft_s is not None and r.e2e_s is not None]
    ttft = [r.ttft_s for r in ok]
    tpot = [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in ok
            if r.completion_tokens and r.completion_tokens > 1]
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p90_s": percentile(tpot, 90),
            "requests": len(result.records), "failed": sum(not r.ok for r in result.records),
            "prompt_tokens_mean": sum(r.prompt_tokens or 0 for r in ok) / max(len(ok), 1),
            "cached_ratio": sum(r.cached_tokens or 0 for r in ok) / max(sum(r.prompt_tokens or 0 for r in ok), 1)}


def predicted_figures(result: SimResult) -> dict[str, float]:
    return result.summary() | {
        "prompt_tokens_mean": sum(o.request.prompt_tokens for o in result.outcomes) / max(len(result.outcomes), 1)}


def run_plan_bench(args: argparse.Namespace) -> int:
    costs = CostModel.load(args.profile)
    names = parse_mixes(args.mixes)
    layout, shape = LAYOUTS[args.layout]
    args.out.mkdir(parents=True, exist_ok=True)
    sizer = make_sizer(_tokenizer_path(args.model))
    report: dict[str, Any] = {"profile": str(args.profile), "profile_meta": costs.meta, "layout": layout.describe(),
                              "threads": args.threads, "mixes": {}}
    port = free_port()
    command = [sys.executable, "-m", "tandem", "up", args.model, "--port", str(port), *shape, "--threads",
               str(args.threads), "--kv-cache-memory", args.kv_cache_memory,
               "--max-num-batched-tokens", str(costs.meta.get("max_num_batched_tokens", 2048)),
               "--log-dir", str(args.out / "logs"), "--ledger", str(args.out / "usage.sqlite3")]
    cluster = LaunchedServer("cluster", command, dict(os.environ), args.out / "cluster.log", port)
    cluster.start()
    try:
        cluster.wait_ready(600)
        for name in names:
            mix = MIXES[name]
            rate = mix.rate * args.rate_scale
            workload = build_serve_workload(scaled(mix.workload, args.size_scale), sizer)
            load = TrafficConfig(request_rate=rate, seed=args.seed)
            logger.info("%s: %s at %.3g sessions/s", name, workload.description, rate)
            started = time.perf_counter()
            result = run_load(cluster.base_url, workload, load, target=args.layout,
                              warmup=[warmup_turn(sizer, args.seed)])
            measured = measured_figures(result)
            simulated = simulate(sim_workload(workload, rate, args.seed), layout, costs,
                                 EngineLimits(max_num_batched_tokens=int(costs.meta.get("max_num_batched_tokens", 2048)),
                                              block_size=costs.block_size))
            predicted = predicted_figures(simulated)
            report["mixes"][name] = {"description": mix.description, "rate": rate, "measured": measured,
                                     "predicted": predicted, "wall_s": time.perf_counter() - started,
                                     "utilisation": simulated.utilisation()}
    finally:
        cluster.stop()
    (args.out / "report.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    print(format_report(report))
    _plot(report, args.out / "plan.png")
    print(f"\nreport: {args.out / 'report.json'}, plot: {args.out / 'plan.png'}")
    return 0


def _tokenizer_path(model: str) -> Path | None:
    from tandem.loader.resolve import resolve_model

    return resolve_model(model).hf_dir / "tokenizer.json"


def errors(mix: dict[str, Any]) -> dict[str, float]:
    return {key: mix["predicted"][key] / mix["measured"][key] - 1.0
            for key in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")}


def format_report(report: dict[str, Any]) -> str:
    meta = report["profile_meta"]
    lines = [f"tandem bench plan: {report['layout']} on {meta.get('machine', {}).get('cpu', '?')}, "
             f"{report['threads']} thread(s) a worker; profile {report['profile']}", ""]
    lines.append(f"{'mix':<14} {'figure':<10} {'measured':>10} {'predicted':>10} {'error':>8}  within 20%")
    for name, mix in report["mixes"].items():
        for key, error in errors(mix).items():
            label = key.removesuffix("_s").replace("_", " ").upper().replace("P50", "p50").replace("P90", "p90")
            lines.append(f"{name:<14} {label:<10} {mix['measured'][key] * 1e3:>8.1f}ms "
                         f"{mix['predicted'][key] * 1e3:>8.1f}ms {error:>+8.1%}  {'yes' if abs(error) <= GOAL else 'NO'}")
        lines.append(f"{'':<14} requests {mix['measured']['requests']} ({mix['measured']['failed']} failed); "
                     f"prompt tokens mean {mix['measured']['prompt_tokens_mean']:.0f} measured, "
                     f"{mix['predicted']['prompt_tokens_mean']:.0f} simulated; cached "
                     f"{mix['measured']['cached_ratio']:.0%} measured, {mix['predicted']['cached_ratio']:.0%} simulated")
    return "\n".join(lines)


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = list(report["mixes"])
    keys = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")
    fig, axes = plt.subplots(1, len(mixes), figsize=(5.5 * len(mixes), 3.8), squeeze=False)
    for ax, name in zip(axes[0], mixes, strict=True):
        mix = report["mixes"][name]
        xs = range(len(keys))
        ax.bar([x - 0.2 for x in xs], [mix["measured"][k] * 1e3 for k in keys], 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [mix["predicted"][k] * 1e3 for k in keys], 0.4, label="predicted")
        ax.set_xticks(list(xs), ["TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90"])
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(f"{name} ({report['layout']})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
