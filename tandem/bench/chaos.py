"""`tandem bench chaos`: load through `tandem up` while workers are killed, and what survived.

Each phase starts a `tandem up` cluster (1 prefill + 2 decode workers by default), runs a
closed loop of streaming greedy chat requests (half of them long enough to be split over a
prefill and a decode worker) for `--duration` seconds, and SIGKILLs workers on a schedule
(`--faults`, seconds:worker). `tandem up` restarts each one; the router moves the streams of
a dead decode worker to another (mid-stream migration) and serves whole what a dead prefill
worker left. Then it waits for every worker to be back and idle and reports:

- requests sent / completed / failed, and streams migrated (the router's counter);
- wrong text: completed streams whose text differs from a clean run of the same prompt
  (a token duplicated or lost at a migration would show here);
- p99 end-to-end latency of requests that overlapped a fault (from the kill until the worker
  is back) and of the others;
- KV blocks leaked: blocks still used, and handed-over KV still held, on any worker once
  nothing runs.

A fault `S:cut:WORKER:D` cuts the link between WORKER and the rest of the cluster for D
seconds instead: the cluster then runs with `tandem up --netns` (each worker in a network
namespace of its own behind a bridge; root and iproute2 needed, else cut faults are left out
with a note), and the worker's end of its link goes down, so its streams go silent rather
than break. The router sees it go down through its health checks and moves its streams.

The peer phase is the same cluster with `--migration-limit 0`: a router that retries only
before the first byte, which is what the peers do by default (NVIDIA Dynamo ships migration
off; vLLM's router and SGLang's have none), so every stream on a killed worker fails there.
Goals: 0 failed requests while each pool keeps a healthy worker; 0 leaked blocks; 0 wrong texts.

`--phases calm,hostile` measures the trust boundary under load instead: the same cluster and
load with no faults, once alone (calm) and once with hostile clients sending the attacks that
once got through (tandem/bench/hostile.py: forged handoff fields, 16,000 sequences in one
request, overflowing sampling values, NaN, lone surrogates, control endpoints without a key,
another tenant's salt, a 400 MiB frame on the KV port) at `--attack-rate` a second. Goals:
every ordinary request completes with its clean-run text, every attack is refused, and the
ordinary clients' p99 stays within 10% of the calm phase's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from tandem.bench.hostile import Attack, Target, attack_loop
from tandem.flags.table import Command, Flag, FlagTable
from tandem.launch import netns
from tandem.launch.netns import WorkerNetwork
from tandem.trust.keys import CLUSTER_SECRET_ENV, secret_from_env
from tandem.trust.peer import peer_client

logger = logging.getLogger(__name__)

_CONTEXT = ("You are the assistant of a travel agency. You answer questions about cities, their "
            "history, food and weather briefly and precisely. ") * 12
_DEFAULT_FAULTS = "10:decode-0,25:cut:decode-1:10,45:prefill-0"
_CITIES = ["Lisbon", "Kyoto", "Lima", "Oslo", "Cairo", "Hanoi", "Quito", "Perth"]


@dataclass
class Request:
    prompt: int
    started: float
    ended: float = 0.0
    ok: bool = False
    text: str = ""
    error: str = ""


@dataclass
class Fault:
    at: float  # seconds after the load started
    worker: str
    cut_s: float | None = None  # a cut link for this long, instead of a SIGKILL
    killed_at: float = 0.0  # monotonic: when the fault began
    back_at: float | None = None  # when it answered /health again

    @property
    def kind(self) -> str:
        return "kill" if self.cut_s is None else "cut"

    def describe(self) -> str:
        return f"SIGKILL {self.worker}" if self.cut_s is None else f"cut {self.worker} for {self.cut_s:g} s"


@dataclass
class PhaseResult:
    name: str
    migration_limit: int
    sent: int = 0
    completed: int = 0
    failed: int = 0
    wrong_text: int = 0
    migrated: int = 0
    retries: int = 0
    p99_during_s: float | None = None
    p99_steady_s: float | None = None
    leaked_blocks: int = 0
    held_handoffs: int = 0
    faults: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # The hostile phase's attacks: kind -> [sent, refused], and what got through.
    attacks: dict[str, list[int]] = field(default_factory=dict)
    attacks_through: list[str] = field(default_factory=list)

    @property
    def attacks_sent(self) -> int:
        return sum(sent for sent, _ in self.attacks.values())

    @property
    def attacks_refused(self) -> int:
        return sum(refused for _, refused in self.attacks.values())


# One table: the cluster, its load and the faults are one experiment, listed as one group.
CHAOS_FLAGS = FlagTable(None, (
    Flag("--model", default="smollm2-135m", help="model (default: smollm2-135m)"),
    Flag("--decode-workers", default=2, type=int, help="decode workers (default: 2)"),
    Flag("--prefill-workers", default=1, type=int, help="prefill workers (default: 1)"),
    Flag("--concurrency", default=16, type=int, help="streams in flight (default: 16)"),
    Flag("--duration", default=60.0, type=float, metavar="S", help="load per phase (default: 60)"),
    Flag("--max-tokens", default=48, type=int, help="tokens per answer (default: 48)"),
    Flag(
        "--faults", default=_DEFAULT_FAULTS, metavar="S:WORKER,S:cut:WORKER:D,...",
        help="S:WORKER SIGKILLs WORKER (a tandem up process name) S seconds into the "
        "load; S:cut:WORKER:D cuts its network link for D seconds (needs root: "
        f"the cluster runs with --netns) (default: {_DEFAULT_FAULTS})",
    ),
    Flag(
        "--idle-timeout", type=float, metavar="S",
        help="the router's --idle-timeout (default: its own)",
    ),
    Flag(
        "--phases", default="peer,tandem",
        help="peer (--migration-limit 0) and/or tandem, under --faults; calm and/or hostile, "
        "without faults, hostile with attacks mixed into the load (default: peer,tandem)",
    ),
    Flag(
        "--attack-rate", default=2.0, type=float, metavar="R",
        help="hostile phase: attacks a second (default: 2)",
    ),
    Flag("--kv-cache-memory", default="512MiB", help="per worker (default: 512MiB)"),
    Flag("--out", default=Path("bench-results/chaos"), type=Path, help="report directory"),
    Flag("--port", default=8450, type=int, help="router port (default: 8450)"),
))


def add_chaos_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chaos", help="load through tandem up while workers are killed: what failed, moved, leaked",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    CHAOS_FLAGS.add_to(parser)
    Command(cmd_chaos, check_chaos).install(parser)


_PHASES = ("peer", "tandem", "calm", "hostile")


def parse_phases(text: str) -> list[str]:
    phases = [p.strip() for p in text.split(",") if p.strip()]
    unknown = set(phases) - set(_PHASES)
    if unknown:
        raise ValueError(f"--phases: unknown {', '.join(sorted(unknown))} ({', '.join(_PHASES)})")
    return phases


def check_chaos(args: argparse.Namespace) -> None:
    """--phases and --faults at parse time: a typo fails before any cluster starts."""
    parse_phases(args.phases)
    parse_faults(args.faults)


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        parts = item.split(":")
        try:
            if len(parts) == 2 and parts[1]:
                faults.append(Fault(float(parts[0]), parts[1]))
            elif len(parts) == 4 and parts[1] == "cut" and parts[2]:
                faults.append(Fault(float(parts[0]), parts[2], cut_s=float(parts[3])))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"--faults: expected S:WORKER or S:cut:WORKER:D, got {item!r}") from None
    return sorted(faults, key=lambda f: f.at)


def prompts(count: int) -> list[list[dict[str, str]]]:
    """Half long (split over prefill and decode), half short (served whole)."""
    out = []
    for i in range(count):
        city = _CITIES[i % len(_CITIES)]
        system = f"Ticket {i}. {_CONTEXT}" if i % 2 else f"Ticket {i}. Be brief."
        out.append([{"role": "system", "content": system},
                    {"role": "user", "content": f"Tell me about {city}, trip number {i}."}])
    return out


async def _stream(client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]],
                  max_tokens: int, record: Request) -> None:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    pieces = []
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                record.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
                return
            done = False
            async for line in reply.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        record.error = str(chunk["error"].get("message"))[:200]
                    for choice in chunk.get("choices") or []:
                        pieces.append((choice.get("delta") or {}).get("content") or "")
            record.ok = done and not record.error
            if not done and not record.error:
                record.error = "stream ended without [DONE]"
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        record.text = "".join(pieces)
        record.ended = time.monotonic()


async def _load(url: str, conversations: list[list[dict[str, str]]], args: argparse.Namespace,
                deadline: float) -> list[Request]:
    records: list[Request] = []
    turn = 0

    async def loop(client: httpx.AsyncClient) -> None:
        nonlocal turn
        while time.monotonic() < deadline:
            index = turn % len(conversations)
            turn += 1
            record = Request(index, time.monotonic())
            records.append(record)
            await _stream(client, url, args.model, conversations[index], args.max_tokens, record)
            if not record.ok:
                await asyncio.sleep(0.2)  # a client's pause before its next request

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits, trust_env=False) as client:
        await asyncio.gather(*(loop(client) for _ in range(args.concurrency)))
    return records


async def _once(url: str, model: str, conversations: list[list[dict[str, str]]],
                max_tokens: int) -> list[Request]:
    """Every conversation once, all at the same time."""
    records = [Request(i, time.monotonic()) for i in range(len(conversations))]
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), trust_env=False) as client:
        await asyncio.gather(*(_stream(client, url, model, conversations[r.prompt], max_tokens, r)
                               for r in records))
    return records


class Cluster:
    """A `tandem up` process and the names of its children."""

    def __init__(self, args: argparse.Namespace, migration_limit: int, log_dir: Path, netns: bool) -> None:
        self.url = f"http://127.0.0.1:{args.port}"
        self.network = WorkerNetwork(args.port) if netns else None
        log_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "tandem", "up", args.model, "--port", str(args.port),
                   "--prefill-workers", str(args.prefill_workers), "--decode-workers", str(args.decode_workers),
                   "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.concurrency),
                   "--migration-limit", str(migration_limit), "--log-dir", str(log_dir / "logs"),
                   "--no-ledger", "--max-restarts", "20", *(["--netns"] if netns else []),
                   *(["--idle-timeout", str(args.idle_timeout)] if args.idle_timeout else [])]
        self.stdout = log_dir / "up.stdout"
        self.stderr = log_dir / "up.stderr"
        # Its workers answer only signed requests: the bench gives the cluster its secret so that
        # it can read their /load (held blocks, handoffs) as the router does.
        self.secret = secret_from_env() or secrets.token_hex(32)
        with self.stdout.open("wb") as out, self.stderr.open("wb") as err:
            self.process = subprocess.Popen(command, stdout=out, stderr=err,
                                             env=dict(os.environ, PYTHONUNBUFFERED="1",
                                                      **{CLUSTER_SECRET_ENV: self.secret}))
        deadline = time.monotonic() + 600
        while "Ctrl-C stops the cluster." not in self.stdout.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tandem up did not start:\n{self.stderr.read_text()[-3000:]}")
            time.sleep(0.5)
        rows = re.findall(r"^  (\S+)\s+(http://\S+)\s+log: ", self.stdout.read_text(), re.MULTILINE)
        self.endpoints = dict(rows)

    def load(self, worker_url: str) -> dict[str, Any]:
        """A worker's GET /load, signed with the cluster secret."""
        with peer_client(self.secret, timeout=5) as client:
            return client.get(f"{worker_url}/load").json()

    def worker_process(self, name: str) -> psutil.Process:
        port = self.endpoints[name].rsplit(":", 1)[1]
        for child in psutil.Process(self.process.pid).children():
            cmdline = child.cmdline()
            if "serve" in cmdline and "--port" in cmdline and cmdline[cmdline.index("--port") + 1] == port:
                return child
        raise LookupError(f"no running process for {name}")

    def kill(self, name: str) -> None:
        victim = self.worker_process(name)
        for process in [*victim.children(recursive=True), victim]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()

    def cut(self, name: str) -> None:
        assert self.network is not None
        self.network.cut(name)

    def mend(self, name: str) -> None:
        assert self.network is not None
        self.network.mend(name)

    def healthy(self, name: str) -> bool:
        try:
            return httpx.get(f"{self.endpoints[name]}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def run_phase(name: str, migration_limit: int, args: argparse.Namespace,
              expected: dict[int, str] | None) -> tuple[PhaseResult, dict[int, str], list[Request]]:
    conversations = prompts(2 * args.concurrency)
    faults = [] if name in ("calm", "hostile") else parse_faults(args.faults)
    attacks: list[Attack] = []
    cluster = Cluster(args, migration_limit, args.out / name, netns=any(f.cut_s for f in faults))
    result = PhaseResult(name, migration_limit)
    try:
        # A clean run of every prompt before any fault, in every phase: the first phase's
        # answers are the expected texts, and each phase starts with the same warm caches
        # (a phase that started cold would be slower for that alone).
        clean = asyncio.run(_once(cluster.url, args.model, conversations, args.max_tokens))
        answered = {r.prompt: r.text for r in clean if r.ok}
        logger.info("%s: clean run: %d of %d prompts answered", name, len(answered), len(conversations))
        if len(answered) < len(conversations):
            errors = sorted({r.error for r in clean if r.error})
            raise RuntimeError(f"the clean run failed before any fault: {'; '.join(errors)[:500]}")
        if expected is None:
            expected = answered
        elif answered != expected:
            raise RuntimeError(f"{name}: a clean run answered differently from the first phase's")
        started = time.monotonic()
        deadline = started + args.duration

        async def inject(fault: Fault) -> None:
            await asyncio.sleep(max(0.0, started + fault.at - time.monotonic()))
            fault.killed_at = time.monotonic()
            logger.info("%s: %s at %.1f s", name, fault.describe(), fault.at)
            if fault.cut_s is None:
                await asyncio.to_thread(cluster.kill, fault.worker)
                return
            await asyncio.to_thread(cluster.cut, fault.worker)
            await asyncio.sleep(fault.cut_s)
            await asyncio.to_thread(cluster.mend, fault.worker)
            while not await asyncio.to_thread(cluster.healthy, fault.worker):
                await asyncio.sleep(0.2)
            fault.back_at = time.monotonic()

        target = _target(cluster, args.model) if name == "hostile" else None

        async def faulted() -> list[Request]:
            load = asyncio.create_task(_load(cluster.url, conversations, args, deadline))
            hostile = asyncio.create_task(attack_loop(target, args.attack_rate, deadline)) if target else None
            await asyncio.gather(*(inject(fault) for fault in faults))
            if hostile is not None:
                done, listener = await hostile
                attacks.extend(done)
                listener.close()
            return await load

        records = asyncio.run(faulted())
        for fault in faults:  # wait until every killed worker answers again
            limit = time.monotonic() + 300
            while not cluster.healthy(fault.worker) and time.monotonic() < limit:
                time.sleep(0.5)
        _settle(cluster)
        result = _summarize(name, migration_limit, records, expected, faults, cluster)
        for attack in attacks:
            counts = result.attacks.setdefault(attack.kind, [0, 0])
            counts[0] += 1
            counts[1] += attack.refused
            if not attack.refused:
                result.attacks_through.append(f"{attack.kind}: {attack.detail}")
    finally:
        cluster.stop()
    return result, expected, records


def _target(cluster: Cluster, model: str) -> Target:
    """What the hostile clients aim at: the router, the workers, a prefill worker's KV port
    (read as the bench, which knows the secret; an attacker would scan for it)."""
    workers = {n: u for n, u in cluster.endpoints.items() if n != "router"}
    kv_port = None
    for name, url in workers.items():
        source = cluster.load(url).get("kv_source") if name.startswith("prefill") else None
        if source:
            host, port = source.removeprefix("tcp://").rsplit(":", 1)
            kv_port = (host, int(port))
            break
    return Target(cluster.url, model, workers, kv_port)


def _settle(cluster: Cluster) -> None:
    """Until no worker runs or holds anything (or 60 s)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        loads = [cluster.load(u) for n, u in cluster.endpoints.items() if n != "router"]
        if all(load["num_requests_in_flight"] == 0 and load["kv_blocks_used"] == 0
               and not (load.get("kv_transfer") or {}).get("held") for load in loads):
            return
        time.sleep(0.5)


def _summarize(name: str, migration_limit: int, records: list[Request], expected: dict[int, str],
               faults: list[Fault], cluster: Cluster) -> PhaseResult:
    result = PhaseResult(name, migration_limit)
    result.sent = len(records)
    result.completed = sum(r.ok for r in records)
    result.failed = result.sent - result.completed
    result.wrong_text = sum(1 for r in records if r.ok and r.prompt in expected and r.text != expected[r.prompt])
    result.errors = sorted({r.error for r in records if r.error})[:10]
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    result.migrated = int(_metric(metrics, "tandem_router_migrations_total"))
    result.retries = int(_metric(metrics, "tandem_router_retries_total"))
    log = cluster.stderr.read_text()
    windows = []
    for fault in faults:
        if fault.cut_s is None:
            back = re.findall(rf"(\d\d:\d\d:\d\d) INFO tandem.launch.up: {re.escape(fault.worker)} is healthy again "
                              r"after ([\d.]+) s", log)
            fault.back_at = fault.killed_at + 1.0 + float(back[-1][1]) if back else None
        windows.append((fault.killed_at, fault.back_at or fault.killed_at + 30.0))
        result.faults.append({"at_s": fault.at, "worker": fault.worker, "kind": fault.kind,
                              "cut_s": fault.cut_s,
                              "back_after_s": None if fault.back_at is None else round(fault.back_at - fault.killed_at, 1)})
    during, steady = [], []
    for r in records:
        if not r.ok:
            continue
        overlaps = any(r.started <= end and r.ended >= start for start, end in windows)
        (during if overlaps else steady).append(r.ended - r.started)
    result.p99_during_s, result.p99_steady_s = _p99(during), _p99(steady)
    for worker, url in cluster.endpoints.items():
        if worker == "router":
            continue
        load = cluster.load(url)
        result.leaked_blocks += int(load["kv_blocks_used"])
        result.held_handoffs += int((load.get("kv_transfer") or {}).get("held") or 0)
    return result


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def hostile_report(results: list[PhaseResult]) -> str:
    """The calm and hostile phases side by side: ordinary clients, and the attacks."""
    calm = next((r for r in results if r.name == "calm"), None)
    lines = ["| phase | ordinary sent | completed | wrong text | p99 e2e (s) | p99 vs calm | attacks sent "
             "| refused | leaked KV blocks |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.name not in ("calm", "hostile"):
            continue
        ratio = (f"{r.p99_steady_s / calm.p99_steady_s:.2f}x" if calm is not None and calm.p99_steady_s
                 and r.p99_steady_s is not None else "-")
        lines.append(f"| {r.name} | {r.sent} | {r.completed} | {r.wrong_text} | {_fmt(r.p99_steady_s)} | {ratio} "
                     f"| {r.attacks_sent} | {r.attacks_refused} | {r.leaked_blocks} |")
    hostile = next((r for r in results if r.name == "hostile"), None)
    if hostile is not None and hostile.attacks:
        lines += ["", "| attack | sent | refused |", "|---|---|---|"]
        lines += [f"| {kind} | {sent} | {refused} |" for kind, (sent, refused) in sorted(hostile.attacks.items())]
    return "\n".join(lines)


def report(results: list[PhaseResult]) -> str:
    results = [r for r in results if r.name not in ("calm", "hostile")]
    if not results:
        return ""
    lines = ["| phase | migration | sent | completed | failed | migrated | wrong text | p99 e2e during faults (s) "
             "| p99 e2e otherwise (s) | leaked KV blocks | held handoffs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {'off' if r.migration_limit == 0 else f'limit {r.migration_limit}'} | {r.sent} "
                     f"| {r.completed} | {r.failed} | {r.migrated} | {r.wrong_text} | {_fmt(r.p99_during_s)} "
                     f"| {_fmt(r.p99_steady_s)} | {r.leaked_blocks} | {r.held_handoffs} |")
    return "\n".join(lines)


def _plot(results: list[tuple[PhaseResult, list[Request]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(results), 1, figsize=(9, 3.2 * len(results)), squeeze=False)
    for axis, (result, records) in zip(axes[:, 0], results, strict=True):
        if not records:
            continue
        zero = min(r.started for r in records)
        for ok, colour, label in ((True, "tab:blue", "completed"), (False, "tab:red", "failed")):
            chosen = [r for r in records if r.ok == ok]
            axis.scatter([r.started - zero for r in chosen], [r.ended - r.started for r in chosen], s=6,
                         c=colour, label=f"{label} ({len(chosen)})")
        for fault in result.faults:
            axis.axvline(fault["at_s"], color="grey", linestyle="--", linewidth=0.8)
            if fault.get("cut_s"):
                axis.axvspan(fault["at_s"], fault["at_s"] + fault["cut_s"], color="orange", alpha=0.15)
            axis.text(fault["at_s"], axis.get_ylim()[1] * 0.9, f" {fault.get('kind', 'kill')} {fault['worker']}",
                      fontsize=7)
        axis.set_title(f"{result.name}: migration {'off' if result.migration_limit == 0 else 'on'}")
        axis.set_xlabel("request start (s into the load)")
        axis.set_ylabel("end-to-end latency (s)")
        axis.legend(loc="upper right", fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def cmd_chaos(args: argparse.Namespace) -> int:
    phases = parse_phases(args.phases)
    faults = parse_faults(args.faults)
    args.out.mkdir(parents=True, exist_ok=True)
    reason = netns.available()
    if reason and any(f.cut_s for f in faults):
        kept = [f for f in faults if f.cut_s is None]
        print(f"note: cut faults left out ({reason}): only SIGKILLs this run", flush=True)
        args.faults = ",".join(f"{f.at:g}:{f.worker}" for f in kept)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    expected: dict[int, str] | None = None
    done: list[tuple[PhaseResult, list[Request]]] = []
    for phase in phases:
        limit = 0 if phase == "peer" else 3
        what = {"calm": "no faults", "hostile": f"no faults, {args.attack_rate:g} attacks/s"}.get(
            phase, f"faults {args.faults}")
        print(f"== {phase}: tandem up, migration {'off' if limit == 0 else 'on'}, {args.duration:g} s of load, "
              f"{what}", flush=True)
        result, expected, records = run_phase(phase, limit, args, expected)
        done.append((result, records))
        print(report([result]) or hostile_report([result]), flush=True)
    results = [r for r, _ in done]
    text = "\n\n".join(t for t in (report(results), hostile_report(results)) if t.count("\n") > 1)
    print("\n" + text)
    for r in results:
        if r.errors:
            print(f"{r.name}: errors seen: " + "; ".join(r.errors))
    (args.out / "chaos.md").write_text(text + "\n")
    (args.out / "chaos.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    _plot(done, args.out / "chaos.png")
    print(f"report: {args.out / 'chaos.md'}, {args.out / 'chaos.json'}, {args.out / 'chaos.png'}")
    ours = next((r for r in results if r.name == "tandem"), None)
    if ours is not None:
        met = ours.failed == 0 and ours.leaked_blocks == 0 and ours.held_handoffs == 0 and ours.wrong_text == 0
        print(f"goals (0 failed, 0 leaked, 0 wrong text): {'met' if met else 'missed'}")
    hostile = next((r for r in results if r.name == "hostile"), None)
    if hostile is not None:
        for line in hostile.attacks_through:
            print(f"attack not refused: {line}")
        calm = next((r for r in results if r.name == "calm"), None)
        within = (calm is not None and calm.p99_steady_s and hostile.p99_steady_s is not None
                  and hostile.p99_steady_s <= 1.10 * calm.p99_steady_s)
        print(f"hostile goals: ordinary requests all completed with clean text: "
              f"{'met' if hostile.failed == 0 and hostile.wrong_text == 0 else 'missed'}; attacks all refused: "
              f"{'met' if hostile.attacks_refused == hostile.attacks_sent else 'missed'}; p99 within 10% of calm: "
              f"{'met' if within else ('missed' if calm is not None else 'no calm phase')}")
    return 0
