"""Tables, ratios and the bar chart of `tandem bench offline` (no torch; matplotlib lazily)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# (key in a result, label, higher is better)
METRICS: dict[str, tuple[str, bool]] = {
    "output_tok_s": ("output tok/s", True),
    "prompt_tok_s": ("prompt tok/s", True),
    "decode_tok_s": ("decode tok/s (1 stream)", True),
    "ttft_s": ("time to first token s", False),
    "ready_s": ("start-to-ready s", False),
    "peak_rss_mib": ("peak RSS MiB", False),
    "agreement": ("greedy tokens = tandem %", True),
}
WORKLOAD_METRICS: dict[str, tuple[str, ...]] = {
    "decode-heavy": ("output_tok_s", "prompt_tok_s", "ready_s", "peak_rss_mib", "agreement"),
    "prefill-heavy": ("output_tok_s", "prompt_tok_s", "ready_s", "peak_rss_mib", "agreement"),
    "single-stream": ("decode_tok_s", "ready_s", "peak_rss_mib", "agreement"),
    "long-prompt": ("ttft_s", "prompt_tok_s", "ready_s", "peak_rss_mib"),
}
REFERENCE = "tandem"


def token_agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> float | None:
    """Share of generated tokens (in %) that lie in the common prefix of both engines' outputs.

    Greedy decoding of the same weights should give the same tokens until two logits nearly tie
    and numerics differ; after the first difference the rest of the sequence is not compared.
    """
    if not reference or len(reference) != len(other):
        return None
    total = same = 0
    for ref, out in zip(reference, other, strict=True):
        total += len(ref)
        for a, b in zip(ref, out, strict=False):
            if a != b:
                break
            same += 1
    return 100.0 * same / total if total else None


def ratio(tandem: float | None, peer: float | None) -> float | None:
    if tandem is None or peer is None or peer == 0 or math.isnan(peer) or math.isnan(tandem):
        return None
    return tandem / peer


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _ratio_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def ratio_rows(results: dict[str, dict[str, dict[str, Any]]], engines: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (workload, metric, peer): tandem's value, the peer's and tandem/peer."""
    rows = []
    peers = [e for e in engines if e != REFERENCE]
    for workload, by_engine in results.items():
        ref = by_engine.get(REFERENCE, {})
        for metric in WORKLOAD_METRICS.get(workload, ()):
            if metric == "agreement":
                continue
            for peer in peers:
                other = by_engine.get(peer, {})
                t = ref.get(metric) if ref.get("ok") else None
                p = other.get(metric) if other.get("ok") else None
                rows.append({"workload": workload, "metric": metric, "peer": peer,
                             "tandem": t, "peer_value": p, "ratio": ratio(t, p),
                             "higher_is_better": METRICS[metric][1]})
    return rows


def format_table(results: dict[str, dict[str, dict[str, Any]]], engines: Sequence[str],
                 title: str = "") -> str:
    """The text table: tandem beside each peer, and tandem/peer after each peer's column.

    ``results[workload][engine]`` is a run result (``ok``, ``error`` and the metric keys).
    A failed run shows ``ERROR`` in its cells and its message under the table.
    """
    engines = [REFERENCE] + [e for e in engines if e != REFERENCE]
    header = ["workload", "metric"]
    for engine in engines:
        header.append(engine)
        if engine != REFERENCE:
            header.append(f"{REFERENCE}/{engine}")
    lines_data: list[list[str]] = []
    errors: list[str] = []
    for workload, by_engine in results.items():
        first = True
        for metric in WORKLOAD_METRICS.get(workload, ()):
            row = [workload if first else "", METRICS[metric][0]]
            first = False
            ref = by_engine.get(REFERENCE, {})
            ref_value = ref.get(metric) if ref.get("ok") else None
            for engine in engines:
                run = by_engine.get(engine)
                if run is None:
                    cells = ["n/a"]
                elif not run.get("ok"):
                    cells = ["ERROR"]
                else:
                    value = run.get(metric)
                    cells = ["" if metric == "agreement" and engine == REFERENCE else _cell(value)]
                if engine != REFERENCE:
                    if metric == "agreement" or run is None or not run.get("ok"):
                        cells.append("")
                    else:
                        cells.append(_ratio_cell(ratio(ref_value, run.get(metric))))
                row += cells
            lines_data.append(row)
        for engine in engines:
            run = by_engine.get(engine)
            if run is not None and not run.get("ok"):
                errors.append(f"{engine} / {workload}: {run.get('error') or 'failed'}")
    widths = [max(len(r[i]) for r in [header, *lines_data]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    out = []
    if title:
        out.append(title)
    out.append(fmt(header))
    out.append("  ".join("-" * w for w in widths))
    out += [fmt(r) for r in lines_data]
    out.append("ratio = tandem / peer: above 1 is better for tok/s and agreement, "
               "below 1 is better for seconds and MiB")
    if errors:
        out.append("errors:")
        out += [f"  {e}" for e in errors]
    return "\n".join(out)


def plot(results: dict[str, dict[str, dict[str, Any]]], engines: Sequence[str], path: Path,
         title: str = "") -> Path:
    """A PNG with one panel per throughput metric plus start-to-ready and peak RSS panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [REFERENCE] + [e for e in engines if e != REFERENCE]
    panels: list[tuple[str, str, list[str]]] = []
    for workload, metric in (("decode-heavy", "output_tok_s"), ("prefill-heavy", "prompt_tok_s"),
                             ("single-stream", "decode_tok_s"), ("long-prompt", "ttft_s")):
        if workload in results:
            better = "" if METRICS[metric][1] else " (lower is better)"
            panels.append((f"{workload}: {METRICS[metric][0]}{better}", metric, [workload]))
    workloads = list(results)
    panels.append(("start-to-ready (s, lower is better)", "ready_s", workloads))
    panels.append(("peak RSS (MiB, lower is better)", "peak_rss_mib", workloads))

    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    for ax, (label, metric, groups) in zip(axes[0], panels, strict=True):
        width = 0.8 / len(engines)
        for e_index, engine in enumerate(engines):
            xs, ys, failed = [], [], []
            for g_index, workload in enumerate(groups):
                run = results.get(workload, {}).get(engine)
                x = g_index + (e_index - (len(engines) - 1) / 2) * width
                if run is not None and run.get("ok") and run.get(metric) is not None:
                    xs.append(x)
                    ys.append(run[metric])
                elif run is not None:
                    failed.append(x)
            bars = ax.bar(xs, ys, width, label=engine, color=colors[e_index % len(colors)])
            ax.bar_label(bars, labels=[_cell(y) for y in ys], fontsize=7)
            for x in failed:
                ax.text(x, 0, "err", ha="center", va="bottom", fontsize=7, color="red")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups if len(groups) > 1 else [""], fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
