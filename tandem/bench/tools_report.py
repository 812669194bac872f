"""The tables, goal lines, JSON and PNG of `tandem bench tools`, one column per target.

Pure Python except the plot (matplotlib, imported lazily with the Agg backend). A figure a
target could not produce (an error, a counter the server lacks) prints as "n/a", never as 0.
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench.tool_scoring import CaseScore, failure_examples, summarize
from tandem.bench.tools_workloads import MODE_TITLES

SCHEMA = "tandem.bench.tools/1"
COST_GOAL = 0.95  # constrained output tok/s over unconstrained
JUMP_GOAL = 1.3  # tokens per model step with jump-forward on

VALIDITY_ROWS: tuple[tuple[str, str], ...] = (
    ("valid_pct", "schema-valid responses %"),
    ("exact_names_pct", "exact names %"),
    ("no_call_pct", "no tool call %"),
    ("call_like_text_pct", "  call-like text, not parsed %"),
    ("errors", "errors (HTTP, transport)"),
    ("calls", "calls returned"),
    ("calls_valid_pct", "calls schema-valid %"),
    ("unknown_tool", "  unknown tool name"),
    ("malformed_json", "  malformed JSON arguments"),
    ("schema_invalid", "  schema violations"),
    ("exact_names_single_pct", "exact names, single %"),
    ("exact_names_enum_pct", "exact names, enum %"),
    ("exact_names_nested_pct", "exact names, nested %"),
    ("exact_names_parallel_pct", "exact names, parallel (2 calls) %"),
    ("prompt_tokens_mean", "mean prompt tokens"),
    ("completion_tokens_mean", "mean output tokens"),
    ("latency_mean_s", "mean latency s"),
)


@dataclass
class TargetRun:
    """Everything measured on one target (a launched server or a URL)."""

    name: str
    base_url: str = ""
    model: str | None = None
    error: str | None = None  # the target could not be measured at all
    launch: dict[str, Any] | None = None
    validity: dict[str, list[CaseScore]] = field(default_factory=dict)  # mode -> scores
    cost: list[dict[str, Any]] = field(default_factory=list)  # one entry per concurrency
    jump: dict[str, dict[str, Any]] = field(default_factory=dict)  # "on" / "off" -> figures
    jump_note: str | None = None  # why there is no "off" run

    def summary(self, mode: str) -> dict[str, Any] | None:
        scores = self.validity.get(mode)
        return summarize(scores) if scores else None


def cell(value: Any, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    return [fmt(header), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)]


def validity_table(runs: Sequence[TargetRun], mode: str) -> str:
    summaries = [r.summary(mode) for r in runs]
    cases = next((s["cases"] for s in summaries if s), 0)
    lines = [f"tool-call validity, {MODE_TITLES[mode]}: {cases} cases"]
    rows = [[label, *(cell(s.get(key)) if s else "n/a" for s in summaries)] for key, label in VALIDITY_ROWS]
    lines += text_table(["", *(r.name for r in runs)], rows)
    for run in runs:
        scores = run.validity.get(mode) or []
        for example in failure_examples(scores):
            lines.append(f"  {run.name}: {example}")
    return "\n".join(lines)


def cost_table(runs: Sequence[TargetRun]) -> str:
    lines = ["cost of constraining: output tok/s, response_format json_schema (strict) vs none"]
    header = ["concurrency"]
    for run in runs:
        header += [f"{run.name} free", f"{run.name} json", f"{run.name} ratio"]
    levels = sorted({c["concurrency"] for run in runs for c in run.cost})
    rows = []
    for level in levels:
        row = [str(level)]
        for run in runs:
            entry = next((c for c in run.cost if c["concurrency"] == level), None)
            if entry is None:
                row += ["n/a"] * 3
                continue
            row += [cell(entry["free"]["output_tok_s"]), cell(entry["constrained"]["output_tok_s"]),
                    cell(entry["ratio"], 3)]
        rows.append(row)
    lines += text_table(header, rows)
    for run in runs:
        for entry in run.cost:
            for kind in ("free", "constrained"):
                part = entry[kind]
                lines.append(f"  {run.name} c={entry['concurrency']} {kind}: {part['requests']} requests, "
                             f"{part['errors']} errors, mean {cell(part['mean_output_tokens'])} output tokens, "
                             f"finish {part['finish_reasons']}"
                             + (f"; first error: {part['first_error']}" if part["first_error"] else ""))
    return "\n".join(lines)


def jump_table(runs: Sequence[TargetRun]) -> str:
    lines = ["jump-forward: tokens per model step = generated / (generated - forced), schema-heavy workload"]
    rows = []
    for run in runs:
        for label, part in run.jump.items():
            rows.append([f"{run.name} ({label})", cell(part["requests"]), cell(part["errors"]),
                         cell(part["generated_tokens"], 0), cell(part["forced_tokens"], 0),
                         cell(part["tokens_per_step"], 2), cell(part["output_tok_s"])])
    lines += text_table(["run", "requests", "errors", "generated", "forced", "tokens/step", "output tok/s"], rows)
    for run in runs:
        if run.jump_note:
            lines.append(f"  {run.name}: {run.jump_note}")
        for label, part in run.jump.items():
            if part.get("first_error"):
                lines.append(f"  {run.name} ({label}): first error: {part['first_error']}")
    return "\n".join(lines)


def goal_lines(run: TargetRun) -> list[str]:
    """The issue's goals, judged on one target's figures ("not measured" where it has none)."""
    lines = []
    strict = run.summary("strict")
    if strict is not None:
        ok = strict["errors"] == 0 and strict["calls"] > 0 and strict["calls_valid_pct"] == 100.0
        lines.append(f"goal ({run.name}, strict): every returned call schema-valid: "
                     f"{cell(strict['calls_valid_pct'])}% of {strict['calls']} calls, {strict['errors']} errors: "
                     f"{'met' if ok else 'NOT met'}")
    required = run.summary("required")
    if required is not None:
        ok = required["errors"] == 0 and required["no_call_pct"] == 0.0 and required["calls_valid_pct"] == 100.0
        lines.append(f"goal ({run.name}, required): a schema-valid call in every response: "
                     f"{cell(required['valid_pct'])}% valid, {cell(required['no_call_pct'])}% without a call: "
                     f"{'met' if ok else 'NOT met'}")
    for entry in run.cost:
        ratio = entry["ratio"]
        verdict = "not measured" if ratio is None else ("met" if ratio >= COST_GOAL else "NOT met")
        lines.append(f"goal ({run.name}, cost at concurrency {entry['concurrency']}): constrained "
                     f">= {COST_GOAL}x unconstrained output tok/s: {_times(ratio)}: {verdict}")
    on = run.jump.get("on")
    if on is not None:
        value = on["tokens_per_step"]
        verdict = "not measured" if value is None else ("met" if value >= JUMP_GOAL else "NOT met")
        lines.append(f"goal ({run.name}, jump-forward): >= {JUMP_GOAL} tokens per model step: "
                     f"{cell(value, 2)}: {verdict}")
    return lines


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.3f}x"


def format_report(runs: Sequence[TargetRun], modes: Sequence[str], title: str) -> str:
    parts = [title]
    parts += [validity_table(runs, mode) for mode in modes if any(r.validity.get(mode) for r in runs)]
    if any(r.cost for r in runs):
        parts.append(cost_table(runs))
    if any(r.jump for r in runs):
        parts.append(jump_table(runs))
    goals = [line for run in runs for line in goal_lines(run)]
    if goals:
        parts.append("\n".join(goals))
    failed = [f"{run.name}: {run.error}" for run in runs if run.error]
    if failed:
        parts.append("\n".join(failed))
    return "\n\n".join(parts)


def build_report(runs: Sequence[TargetRun], *, modes: Sequence[str], cases: Sequence[dict[str, Any]],
                 table: str, args: dict[str, Any], environment: dict[str, Any]) -> dict[str, Any]:
    """The JSON document (schema `tandem.bench.tools/1`): every figure, every case's score."""
    return {
        "schema": SCHEMA,
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "command": sys.argv,
        "environment": environment,
        "args": args,
        "goals": {"cost_ratio": COST_GOAL, "tokens_per_step": JUMP_GOAL},
        "cases": list(cases),
        "table": table,
        "targets": [
            {
                "name": run.name,
                "base_url": run.base_url,
                "model": run.model,
                "error": run.error,
                "launch": run.launch,
                "validity": {mode: {"summary": run.summary(mode),
                                    "scores": [s.to_json() for s in run.validity.get(mode, [])]}
                             for mode in modes if mode in run.validity},
                "cost": run.cost,
                "jump_forward": run.jump,
                "jump_forward_note": run.jump_note,
                "goals": goal_lines(run),
            }
            for run in runs
        ],
    }


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10, color="#666666")


def plot(runs: Sequence[TargetRun], modes: Sequence[str], path: Path, title: str = "") -> Path:
    """A PNG: validity rates per mode and target, constrained vs free tok/s, tokens per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    ax = axes[0]
    groups = [(mode, key, label) for mode in modes
              for key, label in (("valid_pct", "valid"), ("exact_names_pct", "names"), ("no_call_pct", "no call"))]
    width = 0.8 / max(1, len(runs))
    for index, run in enumerate(runs):
        ys = [float((run.summary(mode) or {}).get(key) or 0.0) for mode, key, _ in groups]
        xs = [g + index * width for g in range(len(groups))]
        ax.bar(xs, ys, width, label=run.name, color=colors[index % len(colors)])
    ax.set_xticks([g + width * (len(runs) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{mode}\n{label}" for mode, _, label in groups], fontsize=7)
    ax.set_ylim(0, 105)
    ax.set_ylabel("% of cases")
    ax.set_title("tool-call validity", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)

    ax = axes[1]
    labels, values, shades = [], [], []
    for index, run in enumerate(runs):
        for entry in run.cost:
            for kind in ("free", "constrained"):
                labels.append(f"{run.name}\nc={entry['concurrency']} {'json' if kind == 'constrained' else kind}")
                values.append(float(entry[kind]["output_tok_s"] or 0.0))
                shades.append(colors[index % len(colors)] if kind == "free" else "#999999")
    ax.bar(range(len(values)), values, 0.6, color=shades)
    if values:
        ax.set_ylim(bottom=0)
    else:
        _empty(ax, "not run (--skip-cost)")
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("output tok/s")
    ax.set_title(f"cost of constraining (goal: json >= {COST_GOAL}x free)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)

    ax = axes[2]
    labels, values = [], []
    for run in runs:
        for label, part in run.jump.items():
            labels.append(f"{run.name}\n{label}")
            values.append(float(part["tokens_per_step"] or 0.0))
    ax.bar(range(len(values)), values, 0.6, color=[colors[i % len(colors)] for i in range(len(values))])
    ax.axhline(JUMP_GOAL, color="#d62728", linestyle="--", linewidth=1, label=f"goal {JUMP_GOAL}")
    ax.set_ylim(0, max([JUMP_GOAL, *values]) * 1.15)
    if not values:
        _empty(ax, "not run (--skip-jump-forward)")
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("tokens per model step (0: not measured)")
    ax.set_title("jump-forward", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
