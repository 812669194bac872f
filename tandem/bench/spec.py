"""`tandem bench spec`: speculative decoding's speedup over none, beside what theory predicts.

For each proposer (--methods) and each k (--ks, drafts verified per step, fixed) plus
adaptive k (at most --adaptive-k, chosen per request per step by the engine), on three
kinds of output (tool-call JSON, code edits that quote the prompt's code, free prose;
tandem/bench/spec_workloads.py) at each batch size (--batches; batch 1 is a single stream
of --single-prompts requests one after another, batch B is B distinct requests at once), all
greedy with --max-tokens: the wall time, output tok/s, the speedup over no speculation on
the same requests in the same process, α (accepted / proposed drafts), the mean acceptance
length, and Leviathan's prediction from the measured α (tandem/bench/spec_report.py). Every
speculative output is checked token by token against the baseline's (✗ = a correctness bug).
--adaptive-batches adds cells measured only with no speculation and adaptive k (by default
prose at batch 32: adaptive k must not cost anything there).

Each target model runs in its own process (tandem/bench/spec_worker.py): the default model
with every method that proposes from tokens (ngram, suffix), and, when --methods names
draft_model, the --draft-target model with its --draft-model proposer (own baseline, own
step-time ratio: a plain decode step of the draft over one of the target). Inside a process,
one engine per configuration serves every cell. The baseline engine is measured first on
its own and then stays up: every generate call of a speculative configuration alternates
with the same call on the baseline (request by request at batch 1), and the speedup is the
ratio of those paired times, so load from other processes that comes and goes during the
run weighs on both sides alike (--unpaired: the first pass only, half the time). A method
that fails to start (not built yet, no such model) gets error rows and the run goes on; a
process that dies is restarted for the configurations after the one it died in.

Verdicts are printed for speculative decoding's goals (spec_report.GOALS), with the distance to this
machine's memory-bandwidth bound (tandem/platform/machine.py). Writes results.json, table.txt,
outputs.jsonl (every request's tokens and text) and one PNG per target model to
<output-dir>/spec-<timestamp>/.

Threads default to 1 (--threads): on a small machine shared with other jobs two-thread
GEMMs stall whenever another process takes a core, and the ratio of two runs made minutes
apart is only as good as the runs' stability. The load average is recorded per cell.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.bench.spec_report import (
    BASELINE,
    DRAFT_METHODS,
    SCHEMA,
    ceiling_lines,
    derive,
    format_tables,
    format_verdicts,
    kind_checks,
    plot,
    public_rows,
    verdicts,
)
from tandem.bench.spec_worker import cells_for
from tandem.bench.spec_workloads import (
    KIND_LABELS,
    KINDS,
    WARMUP_CONVERSATION,
    capacity,
    conversations,
)
from tandem.config import DECODE_WEIGHT_FORMATS
from tandem.flags.engine import add_engine_args, engine_values, settle_device
from tandem.flags.table import Command, Flag, FlagTable
from tandem.launch import supervisor
from tandem.platform.machine import host_info

logger = logging.getLogger(__name__)

METHODS = ("ngram", "suffix", "draft_model")
_ALIASES = {"draft": "draft_model"}
DEFAULT_KV = "512MiB"
_STOP_TIMEOUT_S = 5.0


# What is measured (proposers, k, output kinds, batches, the draft model) and where it goes;
# the engine flags come from the engine's own table.
SPEC_BENCH_FLAGS = FlagTable("benchmark", (
    Flag(
        "--methods", default="ngram,suffix",
        help=f"comma-separated proposers, of {', '.join(METHODS)} (draft = draft_model) "
        "(default: ngram,suffix)",
    ),
    Flag(
        "--ks", default="1,2,4,8",
        help="fixed k values: a list and/or ranges, e.g. 1-8 (default: 1,2,4,8)",
    ),
    Flag(
        "--no-adaptive", action="store_false", dest_name="adaptive",
        help="leave out adaptive k (measured by default)",
    ),
    Flag(
        "--adaptive-k", type=int, metavar="K",
        help="most drafts adaptive k may choose per step (default: the largest of --ks)",
    ),
    Flag(
        "--kinds", default=",".join(KINDS),
        help=f"output kinds, of {', '.join(KINDS)} (default: all)",
    ),
    Flag("--batches", default="1,8", help="batch sizes (default: 1,8)"),
    Flag(
        "--adaptive-batches", default="prose:32", metavar="KIND:B,...",
        help="cells measured only with no speculation and adaptive k (default: prose:32; '' for none)",
    ),
    Flag(
        "--single-prompts", default=3, type=int, metavar="N",
        help="requests in a batch-1 cell, run one after another (default: 3)",
    ),
    Flag(
        "--unpaired", switch=True,
        help="measure the baseline once, first, instead of alternating its calls with each "
        "configuration's (half the time; fair only on a machine with no other load)",
    ),
    Flag(
        "--max-tokens", default=128, type=int,
        help="most output tokens per request (default: 128)",
    ),
    Flag(
        "--draft-target", default="qwen2.5-coder-1.5b",
        help="target model of draft_model (default: qwen2.5-coder-1.5b)",
    ),
    Flag(
        "--draft-model", default="qwen2.5-coder-0.5b",
        help="the draft model proposing for it (default: qwen2.5-coder-0.5b)",
    ),
    Flag(
        "--draft-kinds", default="tool",
        help="output kinds measured with draft_model (default: tool)",
    ),
    Flag("--draft-batches", default="1", help="batch sizes measured with draft_model (default: 1)"),
    Flag(
        "--draft-decode-weights", default="int4", choices=("none", *DECODE_WEIGHT_FORMATS),
        help="the weights the draft's small forwards read (speculative config "
        "draft_decode_weights) (default: int4)",
    ),
    Flag(
        "--output-dir", default=Path("bench-results/spec"), type=Path,
        help="where spec-<timestamp>/ goes (default: bench-results/spec)",
    ),
    Flag(
        "--run-timeout", default=3600.0, type=float,
        help="seconds before a target model's process is killed (default: 3600)",
    ),
))


def add_spec_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "spec", help="speculative decoding: speedup per proposer and k vs the Leviathan prediction",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.set_defaults(threads=1)
    SPEC_BENCH_FLAGS.add_to(parser)
    Command(cmd_spec, check_spec_bench).install(parser)


def check_spec_bench(args: argparse.Namespace) -> None:
    """Plan the runs once at parse time: a bad --methods, --ks, --kinds or batch list (or a
    --speculative-config, which this bench sets itself) fails before any process starts."""
    build_plans(args)


# --- planning -----------------------------------------------------------------------------------

def parse_ints(text: str, what: str, low: int = 1, high: int | None = None) -> list[int]:
    """"1,2,4" or "1-8" or "1..8" (or a mix) as sorted distinct ints in [low, high]."""
    values: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        bounds = part.replace("..", "-").split("-")
        try:
            numbers = [int(b) for b in bounds]
        except ValueError:
            raise ValueError(f"{what}: {part!r} is not a number or a range like 1-8") from None
        if len(numbers) == 2:
            if numbers[0] > numbers[1]:
                raise ValueError(f"{what}: empty range {part!r}")
            values.update(range(numbers[0], numbers[1] + 1))
        elif len(numbers) == 1:
            values.add(numbers[0])
        else:
            raise ValueError(f"{what}: {part!r} is not a number or a range like 1-8")
    bad = [v for v in values if v < low or (high is not None and v > high)]
    if bad:
        raise ValueError(f"{what} must be in {low}..{high if high is not None else 'inf'}, got {bad}")
    return sorted(values)


def parse_names(text: str, allowed: tuple[str, ...], what: str, aliases: dict[str, str] | None = None) -> list[str]:
    names = [(aliases or {}).get(x.strip(), x.strip()) for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in allowed]
    if bad:
        raise ValueError(f"unknown {what} {', '.join(bad)}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(names))


def parse_kind_batches(text: str) -> list[tuple[str, int]]:
    out = []
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        kind, _, batch = part.partition(":")
        if kind not in KINDS or not batch.isdigit() or int(batch) < 1:
            raise ValueError(f"--adaptive-batches: {part!r} is not KIND:BATCH with KIND one of {', '.join(KINDS)}")
        out.append((kind, int(batch)))
    return list(dict.fromkeys(out))


def make_cells(kinds: list[str], batches: list[int], single_prompts: int,
               adaptive_only: list[tuple[str, int]] = ()) -> list[dict[str, Any]]:
    cells = [{"kind": kind, "batch": batch, "requests": single_prompts if batch == 1 else batch}
             for kind in kinds for batch in batches]
    for kind, batch in adaptive_only:
        if kind in kinds and batch in batches:
            continue  # measured for every configuration anyway
        cells.append({"kind": kind, "batch": batch, "requests": single_prompts if batch == 1 else batch,
                      "adaptive_only": True})
    return cells


def make_configs(methods: list[str], ks: list[int], adaptive: bool, adaptive_k: int,
                 draft_model: str | None = None, draft_weights: str = "int4") -> list[dict[str, Any]]:
    configs: list[dict[str, Any]] = [{"name": BASELINE, "method": BASELINE, "measure_step": True}]
    for method in methods:
        extra = {"draft_model": draft_model, "draft_weights": draft_weights} if method in DRAFT_METHODS else {}
        configs += [{"name": f"{method}-k{k}", "method": method, "k": k, "adaptive": False, **extra} for k in ks]
        if adaptive:
            configs.append({"name": f"{method}-adaptive{adaptive_k}", "method": method, "k": adaptive_k,
                            "adaptive": True, **extra})
    if draft_model and any(m in DRAFT_METHODS for m in methods):
        # A plain decode step of the draft model alone, for the draft/target step-time ratio.
        configs.append({"name": "draft-alone", "method": BASELINE, "model": draft_model, "step_only": True,
                        "measure_step": True})
    return configs


def build_plans(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One plan per target model process: the default model with the token proposers, and
    the draft target with draft_model when asked for."""
    methods = parse_names(args.methods, METHODS, "methods", _ALIASES)
    if not methods:
        raise ValueError("give at least one method in --methods")
    ks = parse_ints(args.ks, "--ks", 1, 16)
    if not ks and not args.adaptive:
        raise ValueError("nothing to measure: no --ks and --no-adaptive")
    adaptive_k = args.adaptive_k or (max(ks) if ks else 8)
    if not 1 <= adaptive_k <= 16:
        raise ValueError(f"--adaptive-k must be in 1..16, got {adaptive_k}")
    if args.single_prompts < 1 or args.max_tokens < 1:
        raise ValueError("--single-prompts and --max-tokens must be >= 1")
    if getattr(args, "speculative_config", None):
        raise ValueError("tandem bench spec sets the speculative config itself; leave --speculative-config out")
    values = {k: (str(v) if isinstance(v, Path) else v) for k, v in engine_values(args).items()}
    values["kv_cache_memory"] = values.get("kv_cache_memory") or DEFAULT_KV
    plans = []
    token_methods = [m for m in methods if m not in DRAFT_METHODS]
    draft_methods = [m for m in methods if m in DRAFT_METHODS]
    if token_methods:
        kinds = parse_names(args.kinds, KINDS, "kinds")
        batches = parse_ints(args.batches, "--batches", 1)
        extra = parse_kind_batches(args.adaptive_batches) if args.adaptive else []
        plans.append(_plan("main", args.model, values, make_configs(token_methods, ks, args.adaptive, adaptive_k),
                           make_cells(kinds, batches, args.single_prompts, extra), args))
    if draft_methods:
        kinds = parse_names(args.draft_kinds, KINDS, "draft kinds")
        batches = parse_ints(args.draft_batches, "--draft-batches", 1)
        configs = make_configs(draft_methods, ks, args.adaptive, adaptive_k, args.draft_model,
                               args.draft_decode_weights)
        plans.append(_plan("draft", args.draft_target, {**values, "model": args.draft_target}, configs,
                           make_cells(kinds, batches, args.single_prompts), args))
    return plans


def _plan(role: str, model: str, values: dict[str, Any], configs: list[dict[str, Any]], cells: list[dict[str, Any]],
          args: argparse.Namespace) -> dict[str, Any]:
    needed: dict[str, int] = {}
    for cell in cells:
        needed[cell["kind"]] = max(needed.get(cell["kind"], 0), cell["requests"])
    for kind, n in needed.items():
        if n > capacity(kind):
            raise ValueError(f"{KIND_LABELS[kind]}: {n} requests asked for, {capacity(kind)} distinct ones exist")
    return {"role": role, "group": model if role == "main" else f"{model} (draft {args.draft_model})",
            "model": model, "engine_values": {**values, "model": model}, "threads": args.threads,
            "configs": configs, "cells": cells, "max_tokens": args.max_tokens, "warmup": WARMUP_CONVERSATION,
            "paired": not args.unpaired,
            "conversations": {kind: conversations(kind, n) for kind, n in needed.items()}}


def planned_cells(plan: dict[str, Any]) -> int:
    return sum(len(cells_for(c, plan["cells"])) for c in plan["configs"])


# --- running ------------------------------------------------------------------------------------

def _read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
    return records


def run_plan(plan: dict[str, Any], scratch: Path, log_dir: Path, timeout: float, bar: Any) -> list[dict[str, Any]]:
    """Run a plan's configurations in a worker process, restarting it after a crash for the
    configurations still to come; returns every record (rows and events)."""
    remaining = list(plan["configs"])
    records: list[dict[str, Any]] = []
    attempt = 0
    deadline = time.monotonic() + timeout
    while remaining:
        attempt += 1
        tag = f"{plan['role']}-{attempt}"
        rows_path, plan_path = scratch / f"{tag}.rows.jsonl", scratch / f"{tag}.plan.json"
        plan_path.write_text(json.dumps({**plan, "configs": remaining, "rows_path": str(rows_path)}))
        log_path = log_dir / f"{tag}.log"
        child = supervisor.start(supervisor.ProcessSpec(
            f"bench spec / {plan['group']}", (sys.executable, "-m", "tandem.bench.spec_worker", "--spec", str(plan_path)),
            log_path))
        seen = 0
        timed_out = False
        try:
            while child.poll() is None:
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.5)
                seen = _advance(bar, rows_path, seen)
        finally:
            supervisor.stop([child], timeout=_STOP_TIMEOUT_S, log=logger)
        seen = _advance(bar, rows_path, seen)
        mine = _read_records(rows_path)
        records += mine
        started = [r["config"] for r in mine if r.get("event") == "start"]
        if any(r.get("event") == "done" for r in mine):
            break
        # The process died (or ran out of time) in the last configuration it started.
        died_in = started[-1] if started else None
        why = (f"timed out after {timeout:.0f} s" if timed_out
               else f"worker exited with code {child.poll()}") + f": {_tail(log_path)}"
        names = [c["name"] for c in remaining]
        failed_index = names.index(died_in) if died_in in names else 0
        failed = remaining[failed_index] if died_in else None
        done_cells = {(r["kind"], r["batch"]) for r in mine if r.get("config") == died_in and "event" not in r}
        to_fail = [failed] if failed is not None else list(remaining)
        for config in to_fail:
            for cell in cells_for(config, plan["cells"]):
                if config is failed and (cell["kind"], cell["batch"]) in done_cells:
                    continue
                records.append({"group": plan["group"], "model": plan["model"], "config": config["name"],
                                "method": config["method"], "k": config.get("k"), "adaptive": bool(config.get("adaptive")),
                                "kind": cell["kind"], "batch": cell["batch"], "ok": False, "error": why})
                bar.update(1)
        logger.warning("%s: %s", plan["group"], why)
        if failed is None or timed_out:
            if timed_out:  # the configurations never started count as not run
                for config in remaining[failed_index + 1:]:
                    for cell in cells_for(config, plan["cells"]):
                        records.append({"group": plan["group"], "model": plan["model"], "config": config["name"],
                                        "method": config["method"], "k": config.get("k"),
                                        "adaptive": bool(config.get("adaptive")), "kind": cell["kind"],
                                        "batch": cell["batch"], "ok": False, "error": why})
                        bar.update(1)
            break
        remaining = remaining[failed_index + 1:]
    return records


def _advance(bar: Any, path: Path, seen: int) -> int:
    rows = [r for r in _read_records(path) if "event" not in r]
    for row in rows[seen:]:
        bar.update(1)
        bar.set_postfix_str(f"{row['config']} {row['kind']}@{row['batch']}"
                            + (f" {row['wall_s']:.1f}s" if row.get("ok") else " error"))
    return len(rows)


def _tail(path: Path) -> str:
    lines = [x for x in supervisor.log_tail(path, 8).splitlines() if x.strip()][-3:]
    return " | ".join(lines)[-500:] + f" (log: {path})"


# --- the machine --------------------------------------------------------------------------------

def weight_bytes(model: str, dtype: str) -> int | None:
    """Bytes of weights a plain decode step reads (every parameter once), or None if the
    model cannot be resolved here."""
    try:
        from tandem.loader.resolve import resolve_model
        from tandem.sizing.shape import DTYPE_BYTES, read_shape
        from tandem.sizing.tensors import count_params

        resolved = resolve_model(model, dtype)
        shape = read_shape(json.loads((resolved.hf_dir / "config.json").read_text()))
        return count_params(shape).total * DTYPE_BYTES[dtype]
    except Exception as exc:  # noqa: BLE001 - the bound is left out, the figures stand
        logger.warning("no weight size for %s: %s", model, exc)
        return None


def machine(plans: list[dict[str, Any]], dtype: str) -> dict[str, Any]:
    from tandem.platform.machine import memory_copy_bytes_per_s

    # The best of three: another process on the machine only ever slows a copy down.
    return {"memory_bytes_per_s": max(memory_copy_bytes_per_s(256 << 20) for _ in range(3)),
            "groups": {p["group"]: {"weight_bytes": weight_bytes(p["model"], dtype), "dtype": dtype} for p in plans}}


def step_times(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """group -> config -> seconds per plain decode step at batch 1."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        if r.get("event") == "step_time":
            out.setdefault(r["group"], {})[r["config"]] = r["decode_step_s"]
    return out


def draft_forwards(records: list[dict[str, Any]]) -> dict[str, float]:
    """group -> the median seconds of a draft model's one-token guessing forward inside the
    speculative engine (the proposer times its own forwards), over the group's draft rows."""
    by_group: dict[str, list[float]] = {}
    for r in records:
        if r.get("draft_forward_s"):
            by_group.setdefault(r["group"], []).append(r["draft_forward_s"])
    return {group: statistics.median(values) for group, values in by_group.items()}


def draft_ratios(steps: dict[str, dict[str, float]], forwards: dict[str, float] | None = None) -> dict[str, float]:
    """group -> a draft step over a target step: the draft's forward as it runs in the loop
    (its compact weights, the real context) where measured, else the draft alone."""
    ratios = {}
    for group, by in steps.items():
        draft = (forwards or {}).get(group) or by.get("draft-alone")
        if draft and by.get(BASELINE):
            ratios[group] = draft / by[BASELINE]
    return ratios


# --- the report ---------------------------------------------------------------------------------

def build_report(records: list[dict[str, Any]], plans: list[dict[str, Any]], measured: dict[str, Any],
                 host: dict[str, Any], meta: dict[str, Any]) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """(the printed text, the JSON report, the derived rows) from the workers' records."""
    steps = step_times(records)
    forwards = draft_forwards(records)
    ratios = draft_ratios(steps, forwards)
    rows = derive(records, ratios)
    groups = {p["role"]: p["group"] for p in plans}
    convs = {kind: max((p["conversations"].get(kind, []) for p in plans), key=len) for kind in KINDS}
    checks = kind_checks(rows, convs)
    results = verdicts(rows, groups, ratios)
    loads = [x for r in rows for x in (r.get("loadavg") or []) if x is not None]
    text = "\n".join([
        f"tandem bench spec: {', '.join(p['group'] for p in plans)}; {meta['dtype']}, "
        f"{meta['threads'] or 'default'} thread(s), greedy, max_tokens {meta['max_tokens']}, "
        f"{meta['single_prompts']} single-stream requests per cell",
        f"host: {host.get('cpu', '?')}, {host.get('cpu_count')} CPUs; "
        f"{' '.join(host.get('flags', [])) or 'no AVX-512/AMX'}",
        "", format_tables(rows), "",
        "answers of their kind (baseline): " + "; ".join(
            f"{group}: " + ", ".join(f"{KIND_LABELS[k]} {v[0]}/{v[1]}" for k, v in by.items())
            for group, by in checks.items()),
        "plain decode step at batch 1: " + "; ".join(
            f"{group}: " + ", ".join(f"{c} {s * 1000:.1f} ms" for c, s in by.items())
            + (f", a draft forward in the speculative loop {forwards[group] * 1000:.1f} ms" if group in forwards else "")
            for group, by in steps.items()),
        f"load average (1 min) during the cells: {min(loads):.1f} to {max(loads):.1f} on {host.get('cpu_count')} CPUs"
        if loads else "load average not recorded",
        _core_share_line(rows, meta.get("threads")),
        _repeat_line(rows),
        "", "hardware bound:", *ceiling_lines(rows, measured), "", "goals:", format_verdicts(results), "",
        f"wall time {meta['wall_s'] / 60:.1f} min",
    ])
    report = {
        "schema": SCHEMA, "created": dt.datetime.now().isoformat(timespec="seconds"), "command": meta.get("command"),
        "wall_s": meta["wall_s"], "host": host,
        "config": {"plans": [{k: v for k, v in p.items() if k != "conversations"} for p in plans], **{
            k: v for k, v in meta.items() if k not in ("command", "wall_s")}},
        "machine": measured, "step_times": steps, "draft_forwards": forwards, "draft_ratios": ratios, "kind_checks": checks,
        "samples": {f"{r['group']} / {r['kind']}": r["texts"][0] for r in rows
                    if r["method"] == BASELINE and r.get("ok") and r.get("texts")},
        "rows": public_rows(rows), "verdicts": results, "table": text,
    }
    return text, report, rows


def _core_share_line(rows: list[dict[str, Any]], threads: int | None) -> str:
    shares = sorted(r["core_share"] for r in rows if r.get("core_share") is not None)
    if not shares:
        return "core share not measured"
    line = (f"CPU time / wall time of the measured calls: {shares[0]:.2f} to {shares[-1]:.2f}, median "
            f"{shares[len(shares) // 2]:.2f}")
    if threads == 1 and shares[0] < 0.9:
        line += " (one thread: below 1, other processes took the core part of the time)"
    return line


def _repeat_line(rows: list[dict[str, Any]]) -> str:
    checked = [r for r in rows if r.get("baseline_repeats") is not None]
    if not checked:
        return "baseline not re-run (unpaired)"
    failed = [f"{r['kind']}@{r['batch']} beside {r['label']}" for r in checked if not r["baseline_repeats"]]
    return (f"baseline outputs repeated exactly in all {len(checked)} paired cells" if not failed
            else f"✗ the baseline's own greedy outputs changed between runs: {', '.join(failed)}")


def write_report(out_dir: Path, text: str, report: dict[str, Any], rows: list[dict[str, Any]],
                 plans: list[dict[str, Any]]) -> list[Path]:
    """results.json, table.txt, outputs.jsonl and a chart per target model; returns the charts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(report, indent=2))
    (out_dir / "table.txt").write_text(text + "\n")
    # Every request's tokens and text, to check by hand, and with the prompts' tokens to replay a
    # proposer over the baseline's answers (python -m tandem.bench.spec_replay).
    with (out_dir / "outputs.jsonl").open("w") as f:
        for row in rows:
            if row.get("ok") and row.get("outputs") is not None:
                f.write(json.dumps({k: row.get(k) for k in ("group", "label", "kind", "batch", "texts", "outputs",
                                                             "base_outputs", "prompt_token_ids")}) + "\n")
    charts = [plot(rows, p["group"], out_dir / f"spec-{p['role']}.png",
                   f"tandem bench spec: {p['group']}, speedup vs k (dashed: Leviathan, fitted step cost)")
              for p in plans]
    return [c for c in charts if c]


# --- the command --------------------------------------------------------------------------------

def cmd_spec(args: argparse.Namespace) -> int:
    settle_device(args)  # --dtype auto -> this host's dtype (the CLI did it; direct callers may not)
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    started = time.time()
    if Path(args.model).exists():
        args.model = str(Path(args.model).resolve())
    plans = build_plans(args)
    out_dir = args.output_dir / f"spec-{dt.datetime.now():%Y%m%d-%H%M%S}"
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    total = sum(planned_cells(p) for p in plans)
    for plan in plans:
        logger.info("%s: %d configurations (%s), %d cells", plan["group"], len(plan["configs"]),
                    ", ".join(c["name"] for c in plan["configs"]),
                    sum(len(cells_for(c, plan["cells"])) for c in plan["configs"]))
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-spec-") as scratch, logging_redirect_tqdm():
        bar = tqdm(total=total, desc="bench spec", unit="cell")
        for plan in plans:
            records += run_plan(plan, Path(scratch), log_dir, args.run_timeout, bar)
        bar.close()
    text, report, rows = build_report(records, plans, machine(plans, args.dtype), host_info(), {
        "dtype": args.dtype, "threads": args.threads, "max_tokens": args.max_tokens,
        "single_prompts": args.single_prompts, "command": sys.argv, "wall_s": time.time() - started})
    charts = write_report(out_dir, text, report, rows, plans)
    print(text)
    print(f"\nresults: {out_dir / 'results.json'}\ncharts:  {', '.join(str(c) for c in charts)}\nlogs:    {log_dir}")
    main_ok = any(r["method"] == BASELINE and r.get("ok") for r in rows)
    return 0 if main_ok else 1
