"""`tandem bench tools`: tool calls that cannot be malformed, and what constraining costs.

Three parts, each against every target in turn (a launched server, or a running one by URL):

1. Tool-call validity: 224 held-out tool-calling cases generated for this bench (34 tools
   with nested objects, arrays, enums and integer ranges; single calls, enum arguments,
   nested arguments, and two calls in one answer; 2-6 tools each), sent under each --modes:
   tool_choice "auto", tool_choice "required", and "auto" with every function
   "strict": true. Each response is scored: schema-valid (at least one call, every call names
   a declared tool and its arguments are a JSON string that validates against the tool's
   parameters, Draft 2020-12), exact names (the calls' names equal the expected ones as a
   multiset), no call at all. Greedy, non-streamed, max_tokens 256.
2. Cost of constraining: output tok/s of requests for a long JSON catalogue with
   response_format {"type": "json_schema", ..., "strict": true} against the same requests
   without it, at concurrency 1 and 32. Goal: constrained >= 0.95x.
3. Jump-forward: tokens per model step on schemas with long fixed keys, from the server's
   /metrics counters (tandem:generation_tokens_total and
   tandem:structured_forced_tokens_total, read before and after):
   generated / (generated - forced). A launched tandem is measured again with
   `tandem serve --no-jump-forward` when that flag exists. Goal: >= 1.3.

An error response (a 400 for a feature the server lacks) is counted and its message printed;
the run goes on. The report prints one column per target (the first is the reference) and
the goals with whether they are met, writes a JSON report (--report) and a PNG beside it.

Examples:
  tandem bench tools                                   # launch tandem on qwen2.5-coder-0.5b
  tandem bench tools --modes auto,required --skip-cost --skip-jump-forward --num-cases 100
  tandem bench tools --launch tandem --url vllm=http://127.0.0.1:8001   # a peer beside it
  tandem bench tools --url http://127.0.0.1:8000       # a server already running
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.bench.serve import LaunchContext, LaunchedServer, Target, build_server, parse_url_target
from tandem.bench.serve_report import environment_info
from tandem.bench.tool_prompts import ToolCase, build_cases
from tandem.bench.tool_scoring import CaseScore, score_response
from tandem.bench.tools_client import Batch, Reply, post_all, read_counters, served_model
from tandem.bench.tools_flags import LAUNCHABLE, TOOLS_BENCH_TABLES
from tandem.bench.tools_report import TargetRun, build_report, format_report, plot
from tandem.bench.tools_workloads import (
    GENERATION_COUNTER,
    MODES,
    case_body,
    chat_body,
    cost_bodies,
    counter,
    json_schema_format,
    parse_modes,
    record_bodies,
    tokens_per_step,
)
from tandem.flags.table import Command

logger = logging.getLogger(__name__)

NO_JUMP_FORWARD = "--no-jump-forward"
# vLLM parses tool calls only when told how; Qwen2.5 writes hermes-style <tool_call> blocks.
VLLM_TOOL_ARGS = "--enable-auto-tool-choice --tool-call-parser hermes"


def add_tools_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tools",
        help="tool-call validity (auto, required, strict), the cost of JSON-schema constraining "
        "and jump-forward, vs a peer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for table in TOOLS_BENCH_TABLES:
        table.add_to(parser)
    Command(cmd_tools, check_tools_args).install(parser)


# --- the command line ------------------------------------------------------------------------


def parse_levels(text: str) -> list[int]:
    """"1,32" -> [1, 32]."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--cost-concurrency {text!r}: positive integers, comma-separated (e.g. 1,32)")
    return sorted(set(levels))


def plan_targets(urls: list[str], launches: list[str]) -> list[Target]:
    """Launched targets first (tandem before vllm: tandem is the reference), then the URLs; with
    neither, a launched tandem."""
    wanted = {x.strip() for item in launches for x in item.split(",") if x.strip()}
    bad = wanted - set(LAUNCHABLE)
    if bad:
        raise ValueError(f"--launch {', '.join(sorted(bad))}: choose from {', '.join(LAUNCHABLE)}")
    if not wanted and not urls:
        wanted = {"tandem"}
    targets = [Target(engine, launch=engine) for engine in LAUNCHABLE if engine in wanted]
    targets += [parse_url_target(u) for u in urls]
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise ValueError(f"target names must differ: {', '.join(names)} (use --url NAME=URL)")
    return targets


def check_tools_args(args: argparse.Namespace) -> None:
    """Every flag combination the parser alone cannot refuse, before a server starts."""
    parse_modes(args.modes)
    parse_levels(args.cost_concurrency)
    plan_targets(args.url, args.launch)
    for flag, value in (("--num-cases", args.num_cases), ("--max-tokens", args.max_tokens),
                        ("--concurrency", args.concurrency), ("--cost-requests", args.cost_requests),
                        ("--cost-max-tokens", args.cost_max_tokens), ("--jump-requests", args.jump_requests),
                        ("--jump-concurrency", args.jump_concurrency),
                        ("--jump-max-tokens", args.jump_max_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.request_timeout <= 0:
        raise ValueError(f"--request-timeout must be > 0, got {args.request_timeout}")


def jump_forward_flag_exists() -> bool:
    """Whether this tandem's `serve` takes --no-jump-forward (it reads its own --help)."""
    try:
        out = subprocess.run([sys.executable, "-m", "tandem", "serve", "--help"], capture_output=True,
                             text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return NO_JUMP_FORWARD in out.stdout


# --- the parts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What every part needs to send requests to one target."""

    base_url: str
    model: str
    api_key: str | None
    timeout_s: float


def _post(settings: Settings, bodies: list[dict[str, Any]], concurrency: int, desc: str) -> Batch:
    """Post with a progress bar that counts errors."""
    from tqdm import tqdm

    with tqdm(total=len(bodies), desc=desc, unit="req", dynamic_ncols=True) as bar:
        failed = 0

        def on_reply(reply: Reply) -> None:
            nonlocal failed
            failed += reply.error is not None
            bar.update(1)
            if failed:
                bar.set_postfix_str(f"errors {failed}")

        return post_all(settings.base_url, bodies, concurrency, api_key=settings.api_key,
                        timeout_s=settings.timeout_s, on_reply=on_reply)


def run_validity(settings: Settings, cases: list[ToolCase], mode: str, max_tokens: int, concurrency: int,
                 name: str) -> list[CaseScore]:
    bodies = [case_body(case, mode, settings.model, max_tokens) for case in cases]
    batch = _post(settings, bodies, concurrency, f"{name} {mode}")
    return [score_response(case, reply.body, reply.error, reply.latency_s)
            for case, reply in zip(cases, batch.replies, strict=True)]


def batch_figures(batch: Batch) -> dict[str, Any]:
    ok = [r for r in batch.replies if r.error is None]
    reasons: dict[str, int] = {}
    for reply in ok:
        reasons[str(reply.finish_reason)] = reasons.get(str(reply.finish_reason), 0) + 1
    errors = batch.errors
    return {
        "requests": len(batch.replies),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "output_tokens": batch.output_tokens,
        "mean_output_tokens": batch.output_tokens / len(ok) if ok else None,
        "duration_s": batch.duration_s,
        "output_tok_s": batch.output_tok_s,
        "finish_reasons": reasons,
    }


def run_cost(settings: Settings, levels: list[int], requests: int | None, max_tokens: int,
             name: str) -> list[dict[str, Any]]:
    """Free, then constrained, at each concurrency; one untimed request of each kind first."""
    warm = [chat_body(settings.model, [{"role": "user", "content": "Say hi as JSON."}], 8),
            chat_body(settings.model, [{"role": "user", "content": "Say hi as JSON."}], 8,
                      json_schema_format("hi", {"type": "object"}))]
    post_all(settings.base_url, warm, 1, api_key=settings.api_key, timeout_s=settings.timeout_s)
    out = []
    for level in levels:
        count = requests or max(4, level)
        entry: dict[str, Any] = {"concurrency": level}
        for kind in ("free", "constrained"):
            bodies = cost_bodies(settings.model, count, max_tokens, kind == "constrained", f"{level}-{kind}")
            entry[kind] = batch_figures(_post(settings, bodies, level, f"{name} cost c={level} {kind}"))
        free, constrained = entry["free"]["output_tok_s"], entry["constrained"]["output_tok_s"]
        clean = entry["free"]["errors"] == 0 and entry["constrained"]["errors"] == 0
        entry["ratio"] = constrained / free if clean and free and constrained else None
        out.append(entry)
    return out


def _settled_counters(settings: Settings, before: dict[str, float] | None, tokens: int) -> dict[str, float] | None:
    """The counters once they count the run's tokens: a server may count a request just after it
    answered, so read again (up to ~5 s) while the generation counter is short of `tokens`."""
    after = read_counters(settings.base_url, settings.api_key)
    start = counter(before or {}, GENERATION_COUNTER) or 0.0
    deadline = time.monotonic() + 5.0
    while after is not None and time.monotonic() < deadline:
        now = counter(after, GENERATION_COUNTER)
        if now is None or now - start >= tokens:
            break
        time.sleep(0.2)
        after = read_counters(settings.base_url, settings.api_key)
    return after


def run_jump(settings: Settings, requests: int, concurrency: int, max_tokens: int, name: str,
             label: str) -> dict[str, Any]:
    before = read_counters(settings.base_url, settings.api_key)
    bodies = record_bodies(settings.model, requests, max_tokens, tag=label)
    batch = _post(settings, bodies, concurrency, f"{name} jump-forward {label}")
    after = _settled_counters(settings, before, batch.output_tokens)
    figures = batch_figures(batch)
    if before is None or after is None:
        figures |= {"generated_tokens": None, "forced_tokens": None, "tokens_per_step": None,
                    "metrics": "GET /metrics gave no counters"}
    else:
        figures |= tokens_per_step(before, after)
    return figures


# --- targets ---------------------------------------------------------------------------------


def measure(run: TargetRun, settings: Settings, args: argparse.Namespace, cases: list[ToolCase],
            modes: list[str], parts: set[str], jump_label: str) -> None:
    """Run the parts on one target, filling `run`; the jump-forward figures go under `jump_label`
    ("on" for a launched tandem, "as running" for a URL)."""
    for mode in modes:
        run.validity[mode] = run_validity(settings, cases, mode, args.max_tokens, args.concurrency, run.name)
        summary = run.summary(mode) or {}
        logger.info("%s %s: %s%% schema-valid, %s%% exact names, %s%% no call, %d errors", run.name, mode,
                    _pct(summary.get("valid_pct")), _pct(summary.get("exact_names_pct")),
                    _pct(summary.get("no_call_pct")), summary.get("errors", 0))
    if "cost" in parts:
        run.cost = run_cost(settings, parse_levels(args.cost_concurrency), args.cost_requests,
                            args.cost_max_tokens, run.name)
    if "jump" in parts:
        run.jump[jump_label] = run_jump(settings, args.jump_requests, args.jump_concurrency,
                                        args.jump_max_tokens, run.name, jump_label)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _launch_args(args: argparse.Namespace, engine: str, no_jump_forward: bool = False) -> argparse.Namespace:
    """The flags `build_server` reads, with what this bench adds for each engine."""
    values = dict(vars(args))
    if engine == "vllm":
        values["vllm_args"] = f"{VLLM_TOOL_ARGS} {args.vllm_args}".strip()
    if no_jump_forward:
        values["tandem_args"] = f"{args.tandem_args} {NO_JUMP_FORWARD}".strip()
    return argparse.Namespace(**values)


def _with_server(target: Target, launch_args: argparse.Namespace, ctx: LaunchContext, log_dir: Path,
                 timeout_s: float, work: Any) -> dict[str, Any]:
    """Start the target's server, run `work(base_url)`, stop it; returns its launch record."""
    server: LaunchedServer = build_server(target, launch_args, ctx, log_dir)
    logger.info("starting %s: %s", target.name, shlex.join(server.command))
    try:
        server.start()
        ready = server.wait_ready(timeout_s)
        logger.info("%s ready on %s after %.1f s", target.name, server.base_url, ready)
        work(server.base_url)
    finally:
        server.stop()
    return server.describe()


def _settings(base_url: str, args: argparse.Namespace) -> Settings:
    model = args.served_model_name or served_model(base_url, args.api_key)
    return Settings(base_url, model, args.api_key, args.request_timeout)


def bench_target(target: Target, args: argparse.Namespace, ctx: LaunchContext, log_dir: Path,
                 cases: list[ToolCase], modes: list[str], parts: set[str], jump_off: bool) -> TargetRun:
    run = TargetRun(target.name)
    if not target.launch:
        assert target.url is not None
        run.base_url = target.url
        try:
            settings = _settings(target.url, args)
            run.model = settings.model
            measure(run, settings, args, cases, modes, parts, "as running")
        except (ValueError, OSError) as exc:
            run.error = str(exc)
            logger.error("%s: %s", target.name, exc)
        if "jump" in parts:
            run.jump_note = "a running server is measured as it runs (jump-forward on or off, as started)"
        return run

    def work(base_url: str) -> None:
        run.base_url = base_url
        settings = _settings(base_url, args)
        run.model = settings.model
        measure(run, settings, args, cases, modes, parts, "on" if target.launch == "tandem" else "as launched")

    try:
        run.launch = _with_server(target, _launch_args(args, target.launch or ""), ctx, log_dir,
                                  args.server_timeout, work)
    except (ValueError, OSError, RuntimeError) as exc:
        run.error = str(exc)
        logger.error("%s: %s", target.name, exc)
        return run
    if "jump" not in parts:
        return run
    if target.launch != "tandem":
        return run
    if not jump_off:
        run.jump_note = f"`tandem serve` has no {NO_JUMP_FORWARD} flag yet: no 'off' run"
        return run

    def work_off(base_url: str) -> None:
        settings = _settings(base_url, args)
        run.jump["off"] = run_jump(settings, args.jump_requests, args.jump_concurrency, args.jump_max_tokens,
                                   run.name, "off")

    off = Target(f"{target.name}-no-jump-forward", launch="tandem")
    try:
        run.launch["no_jump_forward"] = _with_server(off, _launch_args(args, "tandem", no_jump_forward=True),
                                                     ctx, log_dir, args.server_timeout, work_off)
    except (ValueError, OSError, RuntimeError) as exc:
        run.jump_note = f"the {NO_JUMP_FORWARD} run failed: {exc}"
        logger.error("%s: %s", off.name, exc)
    on, off_figures = run.jump.get("on"), run.jump.get("off")
    if on and off_figures and on["output_tok_s"] and off_figures["output_tok_s"]:
        on["speedup_vs_off"] = on["output_tok_s"] / off_figures["output_tok_s"]
    return run


def _launch_context(targets: list[Target], args: argparse.Namespace) -> LaunchContext:
    ctx = LaunchContext(served_name=args.served_model_name or args.model)
    if any(t.launch == "vllm" for t in targets):
        from tandem.config import parse_memory_size
        from tandem.loader.resolve import resolve_model

        ctx.kv_bytes = parse_memory_size(args.kv_cache_memory)
        ctx.hf_dir = resolve_model(args.model, "float32").hf_dir  # vLLM's checkpoint: float32
    return ctx


def _args_json(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("handler", "check", "api_key") and not callable(v)}


def cmd_tools(args: argparse.Namespace) -> int:
    from tqdm.contrib.logging import logging_redirect_tqdm

    # httpx logs every request at INFO: hundreds of lines that would bury the progress bars
    httpx_logger = logging.getLogger("httpx")
    httpx_logger.setLevel(max(httpx_logger.getEffectiveLevel(), logging.WARNING))
    targets = plan_targets(args.url, args.launch)
    modes = parse_modes(args.modes)
    cases = build_cases(args.num_cases, args.case_seed)
    parts = {p for p, skip in (("cost", args.skip_cost), ("jump", args.skip_jump_forward)) if not skip}
    jump_off = "jump" in parts and any(t.launch == "tandem" for t in targets) and jump_forward_flag_exists()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.output_dir) / f"tools-{stamp}"
    report_path = Path(args.report) if args.report else run_dir / "tools.json"
    log_dir = run_dir / "logs"
    logger.info("%d cases, modes %s, targets %s; cost %s, jump-forward %s", len(cases), ",".join(modes),
                ", ".join(t.name for t in targets), "on" if "cost" in parts else "skipped",
                ("on and off" if jump_off else "on") if "jump" in parts else "skipped")
    environment = environment_info()
    started = time.time()
    runs = []
    with logging_redirect_tqdm():
        ctx = _launch_context(targets, args)
        for target in targets:
            runs.append(bench_target(target, args, ctx, log_dir, cases, modes, parts, jump_off))
    title = (f"tandem bench tools: model {args.model if any(t.launch for t in targets) else runs[0].model}; "
             f"{len(cases)} cases, concurrency {args.concurrency}, max_tokens {args.max_tokens}, greedy")
    table = format_report(runs, modes, title)
    if len(runs) == 1:
        table += ("\n\nno peer in this run: --launch vllm --vllm-python PATH (a venv with vllm) or "
                  "--url NAME=URL (a running peer) puts one beside it")
    report = build_report(runs, modes=[m for m in MODES if m in modes], cases=[c.summary() for c in cases],
                          table=table, environment=environment,
                          args=_args_json(args) | {"wall_s": time.time() - started})
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=1))
    png_path = plot(runs, modes, report_path.with_suffix(".png"), title)
    print(table)
    logs = log_dir if log_dir.exists() else "-"
    print(f"\nresults: {report_path}\nchart:   {png_path}\nlogs:    {logs}")
    return 0 if runs and all(r.error is None for r in runs) else 1
