"""Metrics, the side-by-side table, the PNG and the JSON of `tandem bench serve`.

Pure Python except the plot (matplotlib, imported lazily with the Agg backend). The first
target is the reference: every other target's column is followed by reference / target, so
with tandem first a ratio above 1 on a throughput row and below 1 on a latency row means
tandem is ahead.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
import platform
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench.load_client import RequestRecord, RunResult

SCHEMA = "tandem.bench.serve/1"
LATENCIES = ("ttft", "itl", "tpot", "e2e")
PRICE_INPUT = 0.10  # $ per 1M uncached prompt tokens, for the cost row
PRICE_CACHED_INPUT = 0.025  # $ per 1M cached prompt tokens (a 75% discount)
STATS = ("mean", "p50", "p90", "p99")

# (key, label, higher is better or None for no ratio)
TABLE_ROWS: tuple[tuple[str, str, bool | None], ...] = (
    ("completed", "requests completed", None),
    ("errors", "errors", None),
    ("request_throughput", "requests/s", True),
    ("output_tok_s", "output tok/s", True),
    ("stream_tok_s", "output tok/s per stream", True),  # interleaved protocols only
    ("total_tok_s", "total tok/s (prompt + output)", True),
    *((f"ttft_{s}_ms", f"TTFT {s} ms", False) for s in STATS),
    *((f"itl_{s}_ms", f"ITL {s} ms", False) for s in STATS),
    *((f"tpot_{s}_ms", f"TPOT {s} ms", False) for s in ("mean", "p50")),
    *((f"e2e_{s}_ms", f"end-to-end {s} ms", False) for s in STATS),
    ("cached_pct", "cached prompt tokens %", True),
    ("reusable_pct", "reusable prompt tokens % (ceiling)", None),
    ("input_cost_per_m", "input $ per 1M prompt tokens", False),
    ("prompt_tokens", "prompt tokens (usage)", None),
    ("completion_tokens", "output tokens (usage)", None),
    ("duration_s", "duration s", False),
)


@dataclass
class TargetOutcome:
    """One target of a bench run: its run result, or why there is none."""

    name: str
    base_url: str
    result: RunResult | None = None
    error: str | None = None
    launch: dict[str, Any] | None = None  # command, log, ready seconds (launched servers)
    metrics: dict[str, Any] = field(default_factory=dict)
    # launched clusters: each worker's /load after the run (tandem/bench/cluster_stats.py)
    workers: list[dict[str, Any]] | None = None

    @property
    def ok(self) -> bool:
        return self.result is not None and self.error is None


def split_by_protocol(outcome: TargetOutcome, protocols: Sequence[str], shared_prefix: int = 0) -> list[TargetOutcome]:
    """An interleaved run's outcome as one outcome per protocol, named as separate runs would
    be (chat keeps the target's name, another protocol is `NAME+PROTOCOL`). The protocols shared
    the run's wall time with the same sessions, so their output tok/s over it come out equal
    by construction; what tells them apart is `stream_tok_s`, each protocol's output tokens over
    the time its own requests took (send to last event), which the goal reads instead."""
    if outcome.result is None:
        return [dataclasses.replace(outcome, name=_protocol_name(outcome.name, p)) for p in protocols]
    parts = []
    for protocol in protocols:
        name = _protocol_name(outcome.name, protocol)
        records = [r for r in outcome.result.records if r.protocol == protocol]
        result = dataclasses.replace(outcome.result, target=name, records=records)
        metrics = compute_metrics(result, shared_prefix)
        ok = [r for r in records if r.ok and r.e2e_s]
        busy = sum(r.e2e_s or 0.0 for r in ok)
        tokens = sum(r.completion_tokens if r.completion_tokens is not None else r.output_chunks for r in ok)
        metrics["stream_tok_s"] = tokens / busy if busy > 0 else None
        metrics["interleaved"] = True
        parts.append(dataclasses.replace(outcome, name=name, result=result, metrics=metrics))
    return parts


def _protocol_name(name: str, protocol: str) -> str:
    return name if protocol == "chat" else f"{name}+{protocol}"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _stats_ms(name: str, seconds: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {
        f"{name}_mean_ms": 1000 * sum(seconds) / len(seconds) if seconds else None,
    }
    for q in (50, 90, 99):
        value = percentile(seconds, q)
        out[f"{name}_p{q}_ms"] = None if value is None else 1000 * value
    return out


def reusable_tokens(records: Sequence[RequestRecord], shared_prefix: int = 0, block_size: int = 16) -> int:
    """Prompt tokens an unbounded prefix cache shared by every worker could have served: the
    ceiling of the cached ratio, which a workload's new text per turn sets, not the server.

    A session's turn re-sends its previous turn's prompt and reply, whose KV exists for all
    but the reply's last token (sampled, never fed back); a first turn shares the system
    prefix (``shared_prefix`` tokens) with every first turn before it. Caches hold whole
    blocks, so each figure rounds down to ``block_size``, and the last prompt token is always
    computed. From the servers' usage counts, so it is exact up to the chat template's few
    tokens around the system message and a reply that re-tokenizes differently.
    """
    firsts = [r for r in records if r.ok and r.turn == 0 and r.prompt_tokens]
    very_first = min(firsts, key=lambda r: r.start_s) if firsts else None
    by_turn = {(r.session_id, r.turn): r for r in records if r.ok}
    total = 0
    for record in by_turn.values():
        if not record.prompt_tokens:
            continue
        reusable = 0 if record is very_first else shared_prefix
        previous = by_turn.get((record.session_id, record.turn - 1))
        if previous is not None and previous.prompt_tokens and previous.completion_tokens:
            reusable = max(reusable, previous.prompt_tokens + previous.completion_tokens - 1)
        total += min(reusable, record.prompt_tokens - 1) // block_size * block_size
    return total


def compute_metrics(result: RunResult, shared_prefix: int = 0) -> dict[str, Any]:
    """Aggregate a run's records: latency percentiles, throughput, cache hits, errors.

    Throughputs divide by the run's wall time (first send to last response). Token counts are
    the servers' usage; a request without usage counts its output chunks instead. A server
    that does not report ``cached_tokens`` counts as zero hits, and ``cached_missing`` says for
    how many requests that was assumed.
    """
    records = result.records
    ok = [r for r in records if r.ok]
    duration = result.duration_s
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    tpot = [
        (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)
        for r in ok
        if r.e2e_s is not None and r.ttft_s is not None and (r.completion_tokens or 0) > 1
    ]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    completion_tokens = sum(
        r.completion_tokens if r.completion_tokens is not None else r.output_chunks for r in ok
    )
    cached_tokens = sum(r.cached_tokens or 0 for r in ok)
    errors = Counter(r.error for r in records if not r.ok)
    metrics: dict[str, Any] = {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "skipped": result.skipped_requests,
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_tok_s": completion_tokens / duration if duration > 0 else None,
        "total_tok_s": (prompt_tokens + completion_tokens) / duration if duration > 0 else None,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
        "cached_ratio": cached_tokens / prompt_tokens if prompt_tokens else None,
        "cached_missing": sum(1 for r in ok if r.cached_tokens is None),
        "usage_missing": sum(1 for r in ok if not r.usage_reported),
        "short_outputs": sum(
            1 for r in ok if r.completion_tokens is not None and r.completion_tokens != r.max_tokens
        ),
        "error_messages": [{"error": e, "count": n} for e, n in errors.most_common(5)],
    }
    metrics["cached_pct"] = (
        None if metrics["cached_ratio"] is None else 100 * metrics["cached_ratio"]
    )
    reusable = reusable_tokens(ok, shared_prefix)
    metrics["reusable_pct"] = 100 * reusable / prompt_tokens if prompt_tokens else None
    # What the prompt tokens cost with cached ones discounted (illustrative list prices,
    # PRICE_INPUT / PRICE_CACHED_INPUT per 1M tokens): the cached ratio in dollars.
    metrics["input_cost_per_m"] = (
        None if metrics["cached_ratio"] is None
        else PRICE_INPUT * (1 - metrics["cached_ratio"]) + PRICE_CACHED_INPUT * metrics["cached_ratio"]
    )
    for name, values in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e)):
        metrics.update(_stats_ms(name, values))
    return metrics


def ratio(reference: float | None, other: float | None) -> float | None:
    if (
        reference is None
        or other is None
        or other == 0
        or math.isnan(reference)
        or math.isnan(other)
    ):
        return None
    return reference / other


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1 or value == 0:
        return f"{value:.2f}"
    return f"{value:.3g}"  # small values (dollars per 1M tokens) keep 3 significant digits


def _ratio_cell(value: float | None, higher_is_better: bool) -> str:
    if value is None:
        return "-"
    if math.isclose(value, 1.0, rel_tol=0.005):
        return f"{value:.2f}x"
    better = value > 1 if higher_is_better else value < 1
    return f"{value:.2f}x {'better' if better else 'worse'}"

# Rows only some runs measure: left out of a table where no target has them.
_OPTIONAL_ROWS = frozenset({"stream_tok_s"})


def ratio_rows(outcomes: Sequence[TargetOutcome]) -> list[dict[str, Any]]:
    """One row per (metric, peer) with a ratio: reference value, peer value, reference/peer."""
    if not outcomes:
        return []
    ref, *peers = outcomes
    rows = []
    for key, _, higher in TABLE_ROWS:
        if higher is None:
            continue
        for peer in peers:
            a = ref.metrics.get(key) if ref.ok else None
            b = peer.metrics.get(key) if peer.ok else None
            rows.append(
                {
                    "metric": key,
                    "reference": ref.name,
                    "peer": peer.name,
                    "reference_value": a,
                    "peer_value": b,
                    "ratio": ratio(a, b),
                    "higher_is_better": higher,
                }
            )
    return rows


def format_table(outcomes: Sequence[TargetOutcome], title: str = "") -> str:
    """The text table: one column per target, the reference / target ratio after each peer."""
    if not outcomes:
        return title
    ref = outcomes[0]
    header = ["metric"]
    for index, outcome in enumerate(outcomes):
        header.append(outcome.name)
        if index:
            header.append(f"{ref.name}/{outcome.name}")
    rows: list[list[str]] = []
    for key, label, higher in TABLE_ROWS:
        if key in _OPTIONAL_ROWS and not any(o.metrics.get(key) is not None for o in outcomes):
            continue
        row = [label]
        ref_value = ref.metrics.get(key) if ref.ok else None
        for index, outcome in enumerate(outcomes):
            value = outcome.metrics.get(key) if outcome.ok else None
            cell = _cell(value) if outcome.ok else "ERROR"
            if key == "cached_pct" and outcome.ok and outcome.metrics.get("cached_missing"):
                cell += "*"
            row.append(cell)
            if index:
                ok = higher is not None and outcome.ok and ref.ok
                row.append(_ratio_cell(ratio(ref_value, value), bool(higher)) if ok else "")
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    out = [title] if title else []
    out += [fmt(header), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)]
    if len(outcomes) > 1:
        out.append(f"ratio = {ref.name} / target; 'better' means {ref.name} is ahead on that row")
    notes = []
    for outcome in outcomes:
        m = outcome.metrics
        if not outcome.ok:
            notes.append(f"{outcome.name}: {outcome.error or 'failed'}")
            continue
        if m.get("cached_missing"):
            notes.append(
                f"* {outcome.name}: no cached_tokens in usage for {m['cached_missing']} of "
                f"{m['completed']} requests (counted as 0)"
            )
        if m.get("short_outputs"):
            notes.append(
                f"{outcome.name}: {m['short_outputs']} requests returned fewer or more "
                "tokens than max_tokens (ignore_eos not honoured?)"
            )
        for item in m.get("error_messages", ()):
            notes.append(f"{outcome.name}: {item['count']} x {item['error']}")
        if m.get("skipped"):
            notes.append(f"{outcome.name}: {m['skipped']} turns skipped after a failed turn")
    out += notes
    return "\n".join(out)


def _cdf(ax: Any, values: Sequence[float], label: str, color: str) -> None:
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label, color=color)


def plot(outcomes: Sequence[TargetOutcome], path: Path, title: str = "") -> Path:
    """A PNG: TTFT, ITL and end-to-end latency CDFs with every target's curve on the same
    axes, and a throughput bar chart with the targets side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.4))
    panels = (
        ("ttft", "TTFT (ms)"),
        ("itl", "inter-token latency (ms)"),
        ("e2e", "end-to-end latency (ms)"),
    )
    for ax, (name, label) in zip(axes[0], panels, strict=True):
        spread = []
        for index, outcome in enumerate(outcomes):
            if not outcome.ok or outcome.result is None:
                continue
            records = [r for r in outcome.result.records if r.ok]
            if name == "itl":
                values = [1000 * x for r in records for x in r.itl_s]
            else:
                values = [1000 * v for r in records if (v := getattr(r, f"{name}_s")) is not None]
            if values:
                p50 = percentile(values, 50)
                _cdf(ax, values, f"{outcome.name} (p50 {_cell(p50)})", colors[index % len(colors)])
                spread += [min(values), max(values)]
        positive = [v for v in spread if v > 0]
        if positive and max(positive) / min(positive) > 50:
            ax.set_xscale("log")
        ax.set_xlabel(label, fontsize=9)
        ax.set_ylabel("fraction of requests" if name != "itl" else "fraction of gaps", fontsize=9)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(f"{label.split(' (')[0]} CDF (left is better)", fontsize=10)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="lower right")

    bars = (
        ("output_tok_s", "output tok/s"),
        ("total_tok_s", "total tok/s (prompt + output)"),
        ("cached_pct", "cached prompt tokens %"),
    )
    names = [o.name for o in outcomes]
    for ax, (key, label) in zip(axes[1], bars, strict=True):
        ys = [float(o.metrics.get(key) or 0.0) if o.ok else 0.0 for o in outcomes]
        drawn = ax.bar(
            range(len(outcomes)),
            ys,
            0.6,
            color=[colors[i % len(colors)] for i in range(len(outcomes))],
        )
        ax.bar_label(
            drawn,
            labels=[_cell(y) if o.ok else "error" for y, o in zip(ys, outcomes, strict=True)],
            fontsize=8,
        )
        ax.set_xticks(range(len(outcomes)))
        # many or long target names would run into each other level
        crowded = sum(len(n) for n in names) > 48
        ax.set_xticklabels(names, fontsize=9, rotation=20 if crowded else 0, ha="right" if crowded else "center")
        ax.set_title(f"{label} (higher is better)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ceiling = max((float(o.metrics.get("reusable_pct") or 0.0) for o in outcomes if o.ok), default=0.0)
        if key == "cached_pct" and ceiling:
            ax.axhline(ceiling, color="black", linestyle="--", linewidth=1)
            ax.text(0.01, ceiling, f" ceiling {ceiling:.1f}%", transform=ax.get_yaxis_transform(),
                    fontsize=8, va="bottom")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def environment_info() -> dict[str, Any]:
    """Where the numbers came from: host, Python, load before the run."""
    try:
        from importlib.metadata import version

        tandem_version = version("tandem-serve")
    except Exception:  # not installed as a distribution (a source checkout)
        tandem_version = None
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "cpu_count": os.cpu_count(),
        "processor": platform.processor(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "tandem_version": tandem_version,
    }


def build_report(
    outcomes: Sequence[TargetOutcome],
    *,
    workload: dict[str, Any],
    args: dict[str, Any],
    table: str,
    environment: dict[str, Any] | None = None,
    include_records: bool = True,
) -> dict[str, Any]:
    """The JSON document (schema ``tandem.bench.serve/1``)."""
    return {
        "schema": SCHEMA,
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "command": sys.argv,
        "environment": environment if environment is not None else environment_info(),
        "args": args,
        "workload": workload,
        "reference": outcomes[0].name if outcomes else None,
        "targets": [
            {
                "name": o.name,
                "base_url": o.base_url,
                "ok": o.ok,
                "error": o.error,
                "launch": o.launch,
                "metrics": o.metrics,
                "workers": o.workers,
                "run": o.result.to_json(include_records) if o.result is not None else None,
            }
            for o in outcomes
        ],
        "ratios": ratio_rows(outcomes),
        "table": table,
    }
