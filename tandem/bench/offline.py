"""`tandem bench offline`: offline throughput of tandem beside transformers and vLLM (CPU).

Each (engine, workload) pair runs in its own process (``tandem.bench.offline_worker``), so
start-to-ready and peak RSS belong to one engine and engines never share memory. The parent
builds the fixed-seed workloads (token ids, so every engine gets the very same prompts),
launches the runs one after another, and writes a JSON file, a PNG bar chart and a table of
tandem beside each peer with the ratio tandem / peer.

Engines:
- ``tandem``: ``tandem.LLM`` with the engine flags given here (``--dtype`` etc.).
- ``transformers``: ``AutoModelForCausalLM`` from the same HF directory (float32; a GGUF model
  is the directory tandem converted it into), left-padded batched greedy ``generate``.
- ``vllm``: vLLM's ``LLM`` in the interpreter given by ``--vllm-python`` (a venv with vllm;
  tandem need not be installed there), in tandem's ``--dtype``, prefix caching on, the same KV
  budget and scheduler limits as tandem.
- ``llamacpp``: llama.cpp through ``llama_cpp.Llama`` in the interpreter given by
  ``--llamacpp-python``, on the model's own GGUF file (quantized weights, as llama.cpp users
  run it), one sequence at a time (its Python API has no batching): the peer for the
  single-stream workload; compare with tandem's ``--decode-weights int4``.

Every engine runs one short untimed warm-up request once it is ready. ``--threads`` applies
to all three (vLLM through OMP_NUM_THREADS; left alone, vLLM serves with 1 torch thread while
tandem and transformers take torch's default). On a small or shared machine, pass
``--threads 1``: multi-threaded small GEMMs collapse when another process takes a core.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.bench.offline_layouts import (
    dense_experts_config,
    format_breakdown_table,
    format_ceilings,
    format_layout_table,
    layout_of,
    machine_ceilings,
    mean_breakdown,
    parse_layout,
    plot_breakdown,
    reported_step_reads,
    wants_dense_experts,
)
from tandem.bench.offline_report import format_table, plot, ratio_rows, token_agreement
from tandem.bench.offline_workloads import (
    DEFAULT_WORKLOADS,
    WARMUP_OUTPUT,
    WORKLOAD_NAMES,
    Workload,
    build_workload,
    compute_metrics,
    warmup_prompt,
)
from tandem.flags.engine import ENGINE_FLAGS, add_engine_args, engine_values, settle_device
from tandem.flags.table import Command, Flag, FlagTable
from tandem.launch import supervisor

logger = logging.getLogger(__name__)

ENGINE_NAMES = ("tandem", "transformers", "vllm", "llamacpp")
# Peers that run in an interpreter of their own (a venv outside the repo): engine -> flag dest.
_PEER_PYTHONS = {"vllm": "vllm_python", "llamacpp": "llamacpp_python"}
SCHEMA = "tandem.bench.offline/1"
DEFAULT_BENCH_KV = "2GiB"
_WORKER = Path(__file__).with_name("offline_worker.py")
_STOP_TIMEOUT_S = 5.0  # a run that timed out or was interrupted: SIGINT, then this, then SIGKILL


# What runs (workloads, engines or layouts, scale), the peers' interpreters and where the
# results go; the engine flags come from the engine's own table.
OFFLINE_BENCH_FLAGS = FlagTable("benchmark", (
    Flag(
        "--workloads", default=",".join(DEFAULT_WORKLOADS),
        help=f"comma-separated subset of {','.join(WORKLOAD_NAMES)} "
        f"(default: {','.join(DEFAULT_WORKLOADS)})",
    ),
    Flag(
        "--engines",
        help="comma-separated subset of tandem,transformers,vllm,llamacpp (default: "
        "tandem,transformers, plus vllm and llamacpp when their --*-python is given)",
    ),
    Flag(
        "--vllm-python", metavar="PATH",
        help="Python of a venv with vllm installed (e.g. /opt/venvs/vllm/bin/python)",
    ),
    Flag(
        "--llamacpp-python", metavar="PATH",
        help="Python of a venv with llama-cpp-python installed: llama.cpp on the model's GGUF",
    ),
    Flag(
        "--vllm-no-iomp-preload", switch=True,
        help="do not LD_PRELOAD the venv's libiomp5.so into vLLM (preloaded by default "
        "when present, as vLLM's CPU guide recommends)",
    ),
    Flag(
        "--hf-batch-size", default=16, type=int,
        help="transformers peer: prompts per padded generate call (default: 16)",
    ),
    Flag(
        "--scale", default=1.0, type=float,
        help="shrink request counts and lengths, e.g. 0.1 for a quick run (default: 1.0)",
    ),
    Flag(
        "--layouts", metavar="LIST",
        help="tandem alone in several parallel layouts, side by side, e.g. tp1,tp2,ep2,pp2 "
        "(tpN, ppN, epN, joined by + as in tp2+pp2); ratios are to the first",
    ),
    Flag(
        "--repeats", default=1, type=int, metavar="N",
        help="time each engine's pass N times, each from an empty prefix cache, and report the "
        "pass of the median time (a loaded machine stalls single passes; default: 1)",
    ),
    Flag(
        "--profile", switch=True,
        help="after each timed tandem run, an untimed pass with the ranks' profilers on: "
        "the share of step time in attention, routing, expert GEMMs, all-to-all, "
        "all-reduce and the pipeline",
    ),
    Flag(
        "--workload-seed", default=0, type=int,
        help="seed offset of the request sets (default: 0)",
    ),
    Flag(
        "--output-dir", default="bench-results/offline",
        help="where the JSON, the PNG and the run logs go (default: bench-results/offline)",
    ),
    Flag(
        "--run-timeout", default=3600.0, type=float,
        help="seconds before one engine run is killed and reported as an error (default: 3600)",
    ),
))


def add_offline_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "offline", help="offline throughput / latency vs peers (transformers, vLLM)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(parser)
    OFFLINE_BENCH_FLAGS.add_to(parser)
    Command(cmd_offline, check_offline_bench).install(parser)


# --- planning ------------------------------------------------------------------------------

def parse_list(text: str | None, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [x.strip() for x in (text or "").split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad:
        raise ValueError(f"unknown {what} {', '.join(bad)}; choose from {', '.join(allowed)}")
    if not items:
        raise ValueError(f"give at least one {what[:-1] if what.endswith('s') else what}")
    return list(dict.fromkeys(items))


def select_engines(args: argparse.Namespace) -> list[str]:
    if args.layouts:
        if args.engines is not None:
            raise ValueError("--layouts compares tandem with itself; leave --engines out")
        layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
        for layout in layouts:
            parse_layout(layout)
            if wants_dense_experts(layout) and args.load_format != "dummy":
                raise ValueError(f"layout {layout!r} needs --load-format dummy: a checkpoint's INT4 experts have "
                                 "no run-dtype weights to load")
        return [f"tandem@{layout}" for layout in dict.fromkeys(layouts)]
    if args.engines is None:
        engines = ["tandem", "transformers"] + [
            engine for engine, dest in _PEER_PYTHONS.items() if getattr(args, dest, None)
        ]
    else:
        engines = parse_list(args.engines, ENGINE_NAMES, "engines")
    if "tandem" not in engines:
        engines.insert(0, "tandem")  # the reference every ratio is taken against
    return engines


def select_runs(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The workloads and the engines (or layouts) to run, from the flags."""
    workload_names = parse_list(args.workloads, WORKLOAD_NAMES, "workloads")
    engines = select_engines(args)
    if args.scale <= 0:
        raise ValueError(f"--scale must be > 0, got {args.scale}")
    if getattr(args, "repeats", 1) < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    return workload_names, engines


def check_offline_bench(args: argparse.Namespace) -> None:
    """An unknown workload or engine, --layouts with --engines, a --scale of 0 or --repeats
    of 0 fails at parse time, before any engine starts."""
    select_runs(args)


def tandem_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags given with non-default values, as `--flag value` strings (for titles)."""
    shown = [flag for flag in ENGINE_FLAGS if flag.option not in ("--dtype", "--kv-cache-memory")]
    return [" ".join(flag.to_argv(value)) for flag in shown
            if (value := getattr(args, flag.dest, flag.default)) != flag.default]


def engine_args(engine: str, args: argparse.Namespace, hf_dir: Path, kv_bytes: int) -> dict[str, Any]:
    if engine.startswith("tandem@"):
        values = engine_args("tandem", args, hf_dir, kv_bytes)
        values.update(parse_layout(layout_of(engine)))
        values["world_size"] = 1  # set by the layout's sizes
        if wants_dense_experts(layout_of(engine)):
            if args.load_format != "dummy":
                raise ValueError(f"layout {layout_of(engine)!r} needs --load-format dummy: a checkpoint's INT4 "
                                 "experts have no run-dtype weights to load")
            values["model"] = str(dense_experts_config(hf_dir))
        return values
    if engine == "tandem":
        # Every engine flag, turned into `tandem.LLM` keywords in the worker (tandem.flags.engine), so a
        # flag added to the engine is benchmarkable here without touching this file.
        values = engine_values(args)
        values["kv_cache_memory"] = kv_bytes  # the same budget as vLLM's
        return values
    if engine == "transformers":
        return {"hf_dir": str(hf_dir), "batch_size": args.hf_batch_size, "threads": args.threads}
    if engine == "vllm":
        return {
            # The same dtype as tandem's: a bf16 run is compared with vLLM's bf16 path.
            "model": str(hf_dir), "dtype": args.dtype, "enable_prefix_caching": not args.no_prefix_caching,
            "kv_cache_memory_bytes": kv_bytes, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
            "seed": args.seed,
        }
    if engine == "llamacpp":
        gguf = getattr(args, "gguf_path", None)
        if gguf is None:
            raise ValueError(f"llama.cpp needs a GGUF model; {args.model} is not one")
        # n_ctx: room for the longest workload (long-prompt: 8,000 tokens and one more); llama.cpp
        # refuses a prompt longer than its context ("llama_decode returned 1").
        return {"model_path": str(gguf), "n_ctx": args.max_model_len or 8192, "n_batch": 512,
                "n_threads": args.threads or len(os.sched_getaffinity(0)), "seed": args.seed}
    raise ValueError(f"unknown engine {engine!r}")


def vllm_env(vllm_python: str, preload_iomp: bool, threads: int | None,
             in_process_engine: bool = True) -> dict[str, str]:
    """The environment of a vLLM peer: its venv alone, the KV size from the flag only.

    `in_process_engine` keeps vLLM's V1 engine core in the driver process (the offline
    bench times one process); its OpenAI server keeps the default, a separate process.
    """
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the vLLM venv must not see this venv's packages
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override the KV budget given as a flag
    if in_process_engine:
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if threads:  # vLLM keeps torch at 1 thread for serving unless OMP_NUM_THREADS is set
        env["OMP_NUM_THREADS"] = str(threads)
    if preload_iomp:
        iomp = Path(vllm_python).parent.parent / "lib" / "libiomp5.so"
        if iomp.is_file():
            env["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
    return env


def _command(engine: str, args: argparse.Namespace, scratch: Path) -> tuple[list[str], dict[str, str]]:
    dest = _PEER_PYTHONS.get(engine)
    if dest is None:
        return [sys.executable, "-m", "tandem.bench.offline_worker"], dict(os.environ)
    python = getattr(args, dest, None)
    flag = "--" + dest.replace("_", "-")
    if not python:
        raise ValueError(f"the {engine} engine needs {flag} PATH (the Python of a venv with it)")
    if not Path(python).exists():
        raise FileNotFoundError(f"{flag} {python} does not exist")
    driver = scratch / "peer_offline_driver.py"
    if not driver.exists():
        shutil.copyfile(_WORKER, driver)  # stdlib-only at module level: runs without tandem
    if engine == "vllm":
        return [python, str(driver)], vllm_env(python, not args.vllm_no_iomp_preload, args.threads)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return [python, str(driver)], env


def run_one(engine: str, workload: Workload, args: argparse.Namespace, hf_dir: Path, kv_bytes: int,
            vocab_size: int, scratch: Path, log_dir: Path) -> dict[str, Any]:
    """Launch one worker process and return its raw result (an error result if it failed)."""
    spec_path = scratch / f"{engine}-{workload.name}.spec.json"
    out_path = scratch / f"{engine}-{workload.name}.result.json"
    log_path = log_dir / f"{engine}-{workload.name}.log"
    base = {"engine": engine, "workload": workload.name, "ok": False, "log": str(log_path)}
    try:
        cmd, env = _command(engine, args, scratch)
    except (ValueError, FileNotFoundError) as exc:
        return {**base, "error": str(exc)}
    spec = {
        "engine": engine, "workload": workload.to_json(),
        "engine_args": engine_args(engine, args, hf_dir, kv_bytes),
        "warmup_prompt": warmup_prompt(vocab_size, args.workload_seed), "warmup_tokens": WARMUP_OUTPUT,
        "profile": bool(getattr(args, "profile", False)) and engine.startswith("tandem"),
        "repeats": int(getattr(args, "repeats", 1)),
    }
    out_path.unlink(missing_ok=True)
    spec["launch_time"] = time.time()
    spec_path.write_text(json.dumps(spec))
    child = supervisor.start(supervisor.ProcessSpec(
        f"{engine} / {workload.name}", (*cmd, "--spec", str(spec_path), "--out", str(out_path)),
        log_path, env=env, cwd=scratch))
    try:
        returncode = child.process.wait(timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        return {**base, "error": f"timed out after {args.run_timeout:.0f} s (log: {log_path})"}
    finally:
        # Also reaps stray helpers (e.g. compile workers) a finished run left behind.
        supervisor.stop([child], timeout=_STOP_TIMEOUT_S, log=logger)
    if not out_path.exists():
        return {**base, "error": f"worker exited with code {returncode} and no result: {_log_tail(log_path)}"}
    result = {**json.loads(out_path.read_text()), "log": str(log_path), "returncode": returncode}
    if result.get("ok"):
        result.update(compute_metrics(workload, result))
    return result


def _log_tail(path: Path, lines: int = 3) -> str:
    try:
        tail = [x for x in path.read_text(errors="replace").splitlines() if x.strip()][-lines:]
    except OSError:
        return f"(see {path})"
    return " | ".join(tail)[-600:] + f" (log: {path})"


# --- the command ---------------------------------------------------------------------------

def cmd_offline(args: argparse.Namespace) -> int:
    settle_device(args)  # --dtype auto -> this host's dtype (the CLI did it; direct callers may not)
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from tandem.config import ModelConfig, parse_memory_size
    from tandem.loader.resolve import resolve_model

    workload_names, engines = select_runs(args)
    kv_bytes = parse_memory_size(args.kv_cache_memory or DEFAULT_BENCH_KV)
    if Path(args.model).exists():  # the runs start in a scratch directory
        args.model = str(Path(args.model).resolve())
    # The peers' checkpoint is always float32; dummy weights need only the config.
    resolved = resolve_model(args.model, "float32" if args.load_format != "dummy" else args.dtype)
    args.gguf_path = resolved.source if resolved.source.suffix == ".gguf" else None
    # a multimodal wrapper's (Kimi K2.5) under text_config
    vocab_size = ModelConfig.from_hf(json.loads((resolved.hf_dir / "config.json").read_text())).vocab_size
    workloads = {name: build_workload(name, vocab_size, args.scale, args.workload_seed) for name in workload_names}

    output_dir = Path(args.output_dir)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    log_dir = output_dir / "logs" / stamp
    log_dir.mkdir(parents=True, exist_ok=True)
    logger.info("model %s (peers read %s); engines %s; workloads %s; scale %g; KV budget %.2f GiB each",
                resolved.name, resolved.hf_dir, ",".join(engines), ",".join(workload_names), args.scale,
                kv_bytes / (1 << 30))
    for workload in workloads.values():
        logger.info("%s: %s", workload.name, workload.description)

    runs = [(engine, name) for name in workload_names for engine in engines]
    results: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in workload_names}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="tandem-bench-offline-") as scratch, logging_redirect_tqdm():
        bar = tqdm(runs, desc="bench offline", unit="run")
        for engine, name in bar:
            bar.set_postfix_str(f"{engine} / {name}")
            load = os.getloadavg()[0]  # lags: the previous run counts too, hence no lower bar
            if load > (os.cpu_count() or 1):
                logger.warning("load average %.1f on %d CPUs before %s / %s: other processes will skew "
                               "the timings", load, os.cpu_count() or 1, engine, name)
            result = run_one(engine, workloads[name], args, resolved.hf_dir, kv_bytes, vocab_size,
                             Path(scratch), log_dir)
            results[name][engine] = result
            if result.get("ok"):
                logger.info("%s / %s: ready %.1f s, %.1f s timed, peak RSS %.0f MiB", engine, name,
                            result["ready_s"], result["elapsed_s"], result["peak_rss_mib"])
            else:
                logger.warning("%s / %s failed: %s", engine, name, result.get("error"))

    if args.layouts:
        return _report_layouts(args, resolved, engines, workloads, results, output_dir, stamp, log_dir, started)
    for by_engine in results.values():
        reference = by_engine.get("tandem", {})
        for engine, result in by_engine.items():
            if result.get("ok") and reference.get("ok") and engine != "tandem":
                result["agreement"] = token_agreement(reference["output_token_ids"], result["output_token_ids"])

    flags = " ".join(tandem_flags(args))
    peers = {"vllm": f"vllm {args.dtype}", "transformers": "transformers float32", "llamacpp": "llama.cpp GGUF"}
    shown = ", ".join(peers[e] for e in engines if e in peers)
    title = (f"tandem bench offline: {resolved.name}, tandem {args.dtype}{' ' + flags if flags else ''}"
             f"{', ' + shown if shown else ''}, scale {args.scale:g}, {os.cpu_count()} CPUs"
             f"{f', the median of {args.repeats} timed passes' if args.repeats > 1 else ''}")
    table = format_table(results, engines, title)
    # How far every engine is from this machine's limits (a matmul and a copy measured now).
    ceilings = machine_ceilings(resolved.hf_dir, args.dtype, workloads, own=reported_step_reads(results))
    table += "\n\n" + format_ceilings(ceilings, results, engines)
    report = {
        "schema": SCHEMA,
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "command": sys.argv,
        "wall_s": time.time() - started,
        "model": resolved.name,
        "hf_dir": str(resolved.hf_dir),
        "host": {"platform": platform.platform(), "python": platform.python_version(),
                 "cpu_count": os.cpu_count(), "processor": platform.processor()},
        "config": {
            "engines": engines, "workloads": workload_names, "scale": args.scale, "repeats": args.repeats,
            "workload_seed": args.workload_seed, "tandem_dtype": args.dtype,
            "kv_cache_memory_bytes": kv_bytes, "vllm_python": args.vllm_python,
            "engine_args": {e: engine_args(e, args, resolved.hf_dir, kv_bytes) for e in engines},
        },
        "workloads": {name: w.summary() for name, w in workloads.items()},
        "results": [
            {k: v for k, v in result.items() if k != "output_token_ids"}
            for by_engine in results.values() for result in by_engine.values()
        ],
        "ratios": ratio_rows(results, engines),
        "ceilings": ceilings,
        "table": table,
    }
    json_path = output_dir / f"offline-{stamp}.json"
    json_path.write_text(json.dumps(report, indent=2))
    png_path = plot(results, engines, output_dir / f"offline-{stamp}.png", title)
    print(table)
    print(f"\nresults: {json_path}\nchart:   {png_path}\nlogs:    {log_dir}")
    tandem_ok = all(by_engine.get("tandem", {}).get("ok") for by_engine in results.values())
    return 0 if tandem_ok else 1


def _report_layouts(args: argparse.Namespace, resolved: Any, engines: list[str], workloads: dict[str, Workload],
                    results: dict[str, dict[str, dict[str, Any]]], output_dir: Path, stamp: str, log_dir: Path,
                    started: float) -> int:
    """The --layouts report: each layout's figures beside the first's, and where steps go."""
    flags = " ".join(f for f in tandem_flags(args) if not f.startswith(("--tensor-parallel", "--pipeline-parallel",
                                                                         "--enable-expert")))
    title = (f"tandem bench offline --layouts: {resolved.name}, {args.dtype}{' ' + flags if flags else ''}, "
             f"scale {args.scale:g}, {os.cpu_count()} CPUs")
    table = format_layout_table(results, engines, title)
    breakdown = format_breakdown_table(results, engines)
    variants = {layout_of(e): dense_experts_config(resolved.hf_dir) for e in engines if wants_dense_experts(layout_of(e))}
    ceilings = machine_ceilings(resolved.hf_dir, args.dtype, workloads, variants, reported_step_reads(results))
    table += "\n\n" + format_ceilings(ceilings, results, engines)
    report = {
        "schema": SCHEMA, "created": dt.datetime.now().isoformat(timespec="seconds"), "command": sys.argv,
        "wall_s": time.time() - started, "model": resolved.name, "hf_dir": str(resolved.hf_dir),
        "host": {"platform": platform.platform(), "python": platform.python_version(),
                 "cpu_count": os.cpu_count(), "processor": platform.processor()},
        "config": {"layouts": [layout_of(e) for e in engines], "workloads": list(workloads), "scale": args.scale,
                   "dtype": args.dtype, "load_format": args.load_format, "profile": args.profile},
        "workloads": {name: w.summary() for name, w in workloads.items()},
        "results": [{k: v for k, v in r.items() if k != "output_token_ids"}
                    for by_engine in results.values() for r in by_engine.values()],
        "breakdown": {f"{w}/{layout_of(e)}": mean_breakdown(r["profile"])
                      for w, by_engine in results.items() for e, r in by_engine.items() if r.get("profile")},
        "table": table, "breakdown_table": breakdown, "ceilings": ceilings,
    }
    json_path = output_dir / f"offline-layouts-{stamp}.json"
    json_path.write_text(json.dumps(report, indent=2))
    print(table)
    if breakdown:
        print("\nwhere a step's time goes (profiled pass, mean over ranks; % of step time):\n" + breakdown)
    png = plot_breakdown(results, engines, output_dir / f"offline-layouts-{stamp}.png", title)
    print(f"\nresults: {json_path}" + (f"\nchart:   {png}" if png else "") + f"\nlogs:    {log_dir}")
    return 0 if all(r.get("ok") for by_engine in results.values() for r in by_engine.values()) else 1
