"""`tandem bench kv-tiers`: time to first token of a long prefix served from each KV tier,
against computing it again, in one run.

For each tier a fresh `tandem serve` is launched with only that tier on (CPU memory; local
disk, read through the page cache and, as root, again with the page cache dropped; Redis on
loopback, started by this command; Mooncake Store when its master runs here), and a baseline
with no tier. Each trial, for a distinct seeded prompt of `--prefix-tokens` tokens:

1. the prefix is computed (one request, one output token) and its chunks are stored;
2. the bench waits until the tier's writer confirmed every write (GET /load);
3. the device prefix cache is reset (POST /reset_prefix_cache): only the tier holds it now;
4. the same prefix with another question is sent, streamed, and its TTFT measured; the
   response's `cached_tokens` says how much came from the tier.

Reported per tier: median TTFT, its ratio to recomputing (the goals: CPU <= 0.15x,
disk <= 0.3x, Redis on loopback <= 0.5x), cached tokens, and the load's distance from this
machine's limits: the KV bytes moved over a measured memory-copy bandwidth, and the prefill's
FLOPs over a measured matmul rate. With `--kv-tier-dtypes auto,int8,int4` each tier runs once
per chunk dtype (`--kv-tier-dtype`), and the table adds the tier's bytes per token and their
share of bf16's (goals: int8 <= 0.55x, int4 <= 0.3x). `--kv-cache-dtype` runs every server
(the recompute baseline too) with that device cache: fp8's chunks are its bytes, its scales in
the header. Writes JSON, a table and a PNG to
`<output-dir>/kv-tiers-<timestamp>/`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tandem.bench.serve import LaunchedServer
from tandem.config import KV_CACHE_DTYPES
from tandem.flags.table import Command, Flag, FlagTable
from tandem.platform.machine import matmul_flops_per_s, memory_copy_bytes_per_s
from tandem.platform.ports import free_port
from tandem.trust.keys import secret_from_env
from tandem.trust.peer import peer_client

logger = logging.getLogger(__name__)

GOALS = {"cpu": 0.15, "disk": 0.3, "disk-cold": 0.3, "redis": 0.5, "mooncake": 0.5}
_WORDS = ["harbour", "ship", "tide", "crane", "cargo", "pilot", "anchor", "dock", "lighthouse", "rope", "sail", "keel", "mast", "hull", "captain", "crew", "manifest", "customs", "berth", "quay", "ledger", "voyage", "storm", "compass", "chart"]


# The model, the prefix, the tiers measured and the server's budget: one group.
KV_TIERS_FLAGS = FlagTable(None, (
    Flag("model", default="smollm2-135m", nargs="?", help="model (default: smollm2-135m)"),
    Flag(
        "--prefix-tokens", default=4096, type=int, metavar="N",
        help="prefix length in tokens (default: 4096)",
    ),
    Flag("--trials", default=3, type=int, metavar="N", help="prompts per tier (default: 3)"),
    Flag(
        "--tiers", default="recompute,cpu,disk,disk-cold,redis,mooncake",
        help="comma-separated: recompute, cpu, disk, disk-cold, redis, mooncake "
        "(default: all; disk-cold needs root, mooncake its package)",
    ),
    Flag(
        "--kv-tier-dtypes", default="auto", metavar="LIST",
        help="comma-separated --kv-tier-dtype values each tier is measured with: auto (the "
        "cache's own bytes), bfloat16, int8, int4 (default: auto)",
    ),
    Flag("--kv-cache-memory", default="1GiB", help="device KV budget (default: 1GiB)"),
    Flag("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
         help="the servers' device KV cache dtype (default: auto, the model's)"),
    Flag("--threads", type=int, help="torch threads of the server"),
    Flag("--output-dir", default=Path("bench-results"), type=Path),
    Flag("--seed", default=0, type=int),
))


def add_kv_tiers_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "kv-tiers", help="TTFT of a long prefix from each KV tier vs recomputing it",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    KV_TIERS_FLAGS.add_to(parser)
    Command(cmd_kv_tiers, lambda args: tier_dtypes(args.kv_tier_dtypes)).install(parser)


@dataclass
class TierResult:
    tier: str
    ttft_s: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    dtype: str = "auto"
    block_bytes: int | None = None  # one block of KV as the tier keeps it (/load kv_tiers)
    block_size: int | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        return self.tier if self.dtype == "auto" else f"{self.tier}/{self.dtype}"

    @property
    def bytes_per_token(self) -> float | None:
        return self.block_bytes / self.block_size if self.block_bytes and self.block_size else None

    @property
    def median_ttft(self) -> float | None:
        return statistics.median(self.ttft_s) if self.ttft_s else None


def _prefix_ids(rng: random.Random, tokens: int, encode: Any) -> list[int]:
    """Exactly `tokens` token ids of seeded text, so the prefix ends on a chunk boundary."""
    ids: list[int] = []
    while len(ids) < tokens:
        ids += encode(" ".join(rng.choice(_WORDS) for _ in range(256)))
    return ids[:tokens]


def _server_flags(tier: str, workdir: Path, store_url: str | None) -> list[str]:
    if tier == "cpu":
        return ["--kv-offload-cpu-bytes", "8GiB"]
    if tier in ("disk", "disk-cold"):
        return ["--kv-offload-disk-path", str(workdir / tier), "--kv-store-admit-after", "1"]
    if tier in ("redis", "mooncake"):
        assert store_url is not None
        return ["--kv-store", store_url, "--kv-store-admit-after", "1"]
    return []


def _wait_writes(client: httpx.Client, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tiers = client.get("/load").json().get("kv_tiers") or {}
        writer = tiers.get("writer", {})
        if not writer.get("pending") and not writer.get("queue_depth"):
            return
        time.sleep(0.1)
    raise TimeoutError("the tier's writes were not confirmed in time")


def _drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _ttft(client: httpx.Client, model: str, prompt: str | list[int]) -> tuple[float, int, int]:
    started = time.perf_counter()
    first = None
    usage: dict[str, Any] = {}
    with client.stream("POST", "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return first or (time.perf_counter() - started), int(details.get("cached_tokens", 0)), int(usage.get(
        "prompt_tokens", 0))


def run_tier(tier: str, args: argparse.Namespace, prompts: list[tuple[list[int], list[int], list[int]]],
             log_dir: Path, workdir: Path, store_url: str | None, dtype: str = "auto") -> TierResult:
    result = TierResult(tier, dtype=dtype)
    port = free_port()
    cmd = [sys.executable, "-m", "tandem", "serve", args.model, "--port", str(port), "--no-access-log",
           "--kv-cache-memory", args.kv_cache_memory, *_server_flags(tier, workdir / dtype, store_url)]
    if tier != "recompute" and dtype != "auto":
        cmd += ["--kv-tier-dtype", dtype]
    if args.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    name = result.label.replace("/", "-")
    server = LaunchedServer(f"tier-{name}", cmd, dict(os.environ), log_dir / f"tier-{name}.log", port)
    server.start()
    try:
        server.wait_ready(600)
        # Signed when a cluster secret is in the environment: the worker then serves peers only.
        with peer_client(secret_from_env(), base_url=server.base_url, timeout=600) as client:
            _ttft(client, args.model, "warm up the model " * 8)
            load = client.get("/load").json()
            result.block_size = int(load.get("block_size") or 0) or None
            for n, (prefix, first, second) in enumerate(prompts):
                _ttft(client, args.model, prefix + first)
                _wait_writes(client)
                if result.block_bytes is None:
                    result.block_bytes = int((client.get("/load").json().get("kv_tiers") or {}).get("block_bytes") or 0) or None
                assert client.post("/reset_prefix_cache").json()["reset"]
                if tier == "disk-cold" and not _drop_page_cache():
                    raise PermissionError("dropping the page cache needs root")
                ttft, cached, prompt_tokens = _ttft(client, args.model, prefix + second)
                result.ttft_s.append(ttft)
                result.cached_tokens.append(cached)
                result.prompt_tokens.append(prompt_tokens)
                logger.info("%-9s trial %d: TTFT %.3f s, %d of %d prompt tokens cached", result.label, n, ttft, cached,
                            prompt_tokens)
    except Exception as exc:  # noqa: BLE001 - one tier failing must not lose the others
        result.error = f"{type(exc).__name__}: {exc}"
        logger.error("%s: %s (log: %s)", result.label, result.error, server.log_path)
    finally:
        server.stop()
    return result


def machine_limits(kv_bytes_per_token: int, params: int, tokens: int) -> dict[str, float]:
    """What this machine could do at best: a memory copy of the prefix's KV, and its prefill's
    matmul FLOPs at the measured fp32 matmul rate (2 threads, torch)."""
    copy_bps = memory_copy_bytes_per_s()
    flops = matmul_flops_per_s("float32")
    kv_bytes = kv_bytes_per_token * tokens
    return {"memcpy_bytes_per_s": copy_bps, "matmul_flops_per_s": flops, "kv_bytes": kv_bytes,
            "ideal_load_s": kv_bytes / copy_bps, "ideal_prefill_s": 2 * params * tokens / flops}


TIER_DTYPES = ("auto", "bfloat16", "int8", "int4")
# The tier bytes a chunk may take, as a share of bf16's, for each narrower dtype.
BYTES_GOALS = {"int8": 0.55, "int4": 0.3}


def tier_dtypes(text: str) -> list[str]:
    """--kv-tier-dtypes as a list, each a --kv-tier-dtype choice (ValueError naming a bad one)."""
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in TIER_DTYPES]
    if bad or not dtypes:
        raise ValueError(f"--kv-tier-dtypes takes {', '.join(TIER_DTYPES)}, not {text!r}")
    return dtypes


def report(results: list[TierResult], limits: dict[str, float]) -> tuple[str, dict[str, Any]]:
    base = next((r.median_ttft for r in results if r.tier == "recompute"), None)
    bf16 = limits.get("bf16_bytes_per_token")
    lines = [f"{'tier':<15} {'TTFT p50':>10} {'x recompute':>12} {'goal':>7} {'cached':>14} "
             f"{'B/token':>9} {'x bf16':>7}  verdict"]
    rows = []
    for r in results:
        ttft = r.median_ttft
        ratio = ttft / base if ttft and base else None
        goal = GOALS.get(r.tier)
        verdict = "error: " + r.error if r.error else (
            "-" if goal is None or ratio is None else ("met" if ratio <= goal else "MISSED"))
        cached = f"{statistics.median(r.cached_tokens):.0f}/{statistics.median(r.prompt_tokens):.0f}" \
            if r.cached_tokens else "-"
        per_token = r.bytes_per_token
        bytes_ratio = per_token / bf16 if per_token and bf16 else None
        bytes_goal = BYTES_GOALS.get(r.dtype)
        if bytes_goal is not None and bytes_ratio is not None and not r.error:
            verdict += "; bytes " + ("met" if bytes_ratio <= bytes_goal else "MISSED") + f" (<={bytes_goal}x bf16)"
        lines.append(f"{r.label:<15} {_fmt(ttft, ' s'):>10} {_fmt(ratio, 'x'):>12} "
                     f"{('<=' + str(goal)) if goal else '':>7} {cached:>14} "
                     f"{f'{per_token:.0f}' if per_token else '-':>9} {_fmt(bytes_ratio, 'x'):>7}  {verdict}")
        rows.append({**asdict(r), "label": r.label, "median_ttft_s": ttft, "ratio_to_recompute": ratio,
                     "goal": goal, "bytes_per_token": per_token, "bytes_ratio_to_bf16": bytes_ratio,
                     "bytes_goal": bytes_goal, "verdict": verdict})
    lines.append("")
    lines.append(f"machine limits: the prefix's KV is {limits['kv_bytes'] / 1e6:.0f} MB; a memory copy of it "
                 f"takes {limits['ideal_load_s'] * 1000:.0f} ms at {limits['memcpy_bytes_per_s'] / 1e9:.1f} GB/s; "
                 f"its prefill's weight FLOPs take {limits['ideal_prefill_s']:.2f} s at "
                 f"{limits['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s")
    return "\n".join(lines), {"tiers": rows, "machine": limits}


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}{unit}" if unit.strip() == "s" else f"{value:.2f}{unit}"


def plot(results: list[TierResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if r.median_ttft is not None]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([r.label for r in shown], [r.median_ttft for r in shown],
           color=["#888" if r.tier == "recompute" else "#3a7" for r in shown])
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title("TTFT of a long prefix by KV tier")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_kv_tiers(args: argparse.Namespace) -> int:
    from tandem.launch.redis_server import RedisServer

    logging.getLogger("httpx").setLevel(logging.WARNING)
    out_dir = args.output_dir / f"kv-tiers-{dt.datetime.now():%Y%m%d-%H%M%S}"
    out_dir.mkdir(parents=True, exist_ok=True)
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    dtypes = tier_dtypes(args.kv_tier_dtypes)
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="tandem-kv-tiers-"))
    # Prompts are made once, with the model's tokenizer, and shared by every tier.
    from tandem.loader.resolve import resolve_model
    from tandem.loader.tokenizer import load_tokenizer

    resolved = resolve_model(args.model, "float32")
    tokenizer = load_tokenizer(resolved.hf_dir)
    encode = tokenizer.encode
    prompts = [(_prefix_ids(rng, args.prefix_tokens, encode), encode(f" Question {n}: which ship came first?"),
                encode(f" Question {n}: and which came last?")) for n in range(args.trials)]
    results: list[TierResult] = []
    for tier in tiers:
        store, store_url = None, None
        try:
            if tier == "redis":
                store = RedisServer(maxmemory_bytes=8 << 30, log_path=out_dir / "redis.log").start()
                store_url = store.url
            elif tier == "mooncake":
                from tandem.launch.mooncake_master import MooncakeMaster  # type: ignore[import-not-found]

                store = MooncakeMaster(log_path=out_dir / "mooncake-master.log").start()
                store_url = store.url + "?segment=4GiB"
        except Exception as exc:  # noqa: BLE001 - reported as that tier's result
            results.append(TierResult(tier, error=f"{type(exc).__name__}: {exc}"))
            continue
        try:
            for dtype in (["auto"] if tier == "recompute" else dtypes):
                results.append(run_tier(tier, args, prompts, out_dir, workdir, store_url, dtype))
        finally:
            if store is not None:
                store.stop()
    from tandem.config import ModelConfig
    from tandem.loader.model_loader import read_model_config

    config: ModelConfig = read_model_config(resolved.hf_dir)
    kv_per_token = config.kv_spec.values_per_token(config.num_hidden_layers) * 4
    params = _num_params(config)
    limits = machine_limits(kv_per_token, params, args.prefix_tokens)
    limits["bf16_bytes_per_token"] = kv_per_token / 2
    table, data = report(results, limits)
    print(table)
    data["args"] = {k: str(v) for k, v in vars(args).items() if k != "handler"}
    (out_dir / "results.json").write_text(json.dumps(data, indent=2))
    (out_dir / "table.txt").write_text(table + "\n")
    plot(results, out_dir / "ttft.png")
    print(f"\nresults: {out_dir}")
    return 0 if all(r.error is None for r in results) else 1


def _num_params(config: Any) -> int:
    """Weights a token's forward pass multiplies by (embeddings excluded)."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * config.head_dim
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * i
    return layers * per_layer + h * config.vocab_size
