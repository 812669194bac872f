"""The arithmetic, tables, chart and goal verdicts of `tandem bench spec` (no torch).

Per measured cell (a configuration on one output kind at one batch size):

- speedup = the baseline's wall time / this configuration's wall time, baseline = no
  speculation on the same requests, in the same process. Paired (the default), the two
  engines' generate calls alternate (request by request at batch 1), so a machine whose other
  load drifts weighs on both alike; `cpu x` is the same ratio of the process's CPU time, a
  check on the wall-time figure when other processes share the cores, and the core share
  (CPU time / wall time, one thread) says how much of a core the bench actually had.
- α = accepted / proposed draft tokens of the cell (vLLM's acceptance rate), and the mean
  acceptance length = 1 + accepted / verifications (vLLM's: tokens per step that verified
  drafts, the target's own token included).
- Leviathan et al.: with k drafts per step each accepted with probability α independently,
  a target step yields E = (1 − α^(k+1)) / (1 − α) tokens. `pred =` is E itself: the speedup
  if a step verifying k drafts cost what a plain step costs (and drafts were free). `pred
  cost` divides E by what the verification step costs relative to a plain step under the
  step cost the engine fitted (seconds ≈ fixed + per_token × tokens):
  (fixed + per_token·B·(1+k)) / (fixed + per_token·B), plus k·c for a draft model whose step
  costs c target steps. An adaptive row uses its mean k (draft tokens per verification).
- time s / base s: this configuration's seconds and, paired, the baseline's seconds for the
  same calls made alternately with them (the baseline row's own time is its first pass).
- 1st tok = this row's time to the first token over the baseline's (summed over the calls;
  a draft model computes its own KV of the prompt in the first step, so its first token
  comes later), decode x = the speedup of the rest of the wall time, after each call's first
  token: what speculation speeds up. `speedup`, over the whole time, is what goals judge.
- steps x = the baseline's engine steps / this row's: the speedup if a step that verifies
  drafts cost what a plain step costs, measured rather than predicted. `pred =` against
  `steps x` tests Leviathan's model of acceptance (each draft token accepted independently
  with probability α; copying proposers fail or succeed in runs, so the mean acceptance
  length beats E(α, k) at large k); `steps x` against `speedup` is the price of the
  verification steps, which `pred cost` estimates from the engine's linear step-cost fit.
- drafted = the share of output tokens that came out of steps that verified drafts: where
  the proposer had no guess (prose, for n-grams) the step is a plain one, which the
  prediction (every step drafts) does not know.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tandem.bench.spec_workloads import KIND_LABELS, KINDS
from tandem.spec.adaptive import expected_tokens_per_step

SCHEMA = "tandem.bench.spec/1"
BASELINE = "baseline"
COPY_METHODS = ("ngram", "suffix")
DRAFT_METHODS = ("draft_model",)

# Speculative decoding's goals: (id, text, what qualifies, the bar). `mode` best: the best qualifying
# row must reach the bar; worst: every qualifying row must, at every batch listed.
GOALS: tuple[dict[str, Any], ...] = (
    {"id": "copy-2x", "text": "ngram or suffix >= 2x on code edits, single stream, default model",
     "group": "main", "methods": COPY_METHODS, "adaptive": None, "kind": "code", "batches": (1,),
     "bar": 2.0, "mode": "best"},
    {"id": "draft-1.4x", "text": "draft (0.5B -> 1.5B) >= 1.4x on tool-call outputs at batch 1",
     "group": "draft", "methods": DRAFT_METHODS, "adaptive": None, "kind": "tool", "batches": (1,),
     "bar": 1.4, "mode": "best"},
    {"id": "adaptive-prose", "text": "adaptive k never > 5% slower than no speculation on prose, batch 1 and 32",
     "group": None, "methods": None, "adaptive": True, "kind": "prose", "batches": (1, 32),
     "bar": 0.95, "mode": "worst"},
)


# --- the prediction -----------------------------------------------------------------------------

def leviathan_tokens(alpha: float, k: float) -> float:
    """Tokens per target step with k drafts each accepted with probability α."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {alpha}")
    return expected_tokens_per_step(alpha, k)  # type: ignore[arg-type]


def verify_cost_ratio(cost: tuple[float, float] | list[float] | None, batch: int, k: float) -> float | None:
    """A step over B·(1+k) tokens over a step over B tokens, by the fitted step cost."""
    if not cost:
        return None
    fixed, per_token = cost
    plain = fixed + per_token * batch
    return (fixed + per_token * batch * (1 + k)) / plain if plain > 0 else None


def predicted_speedups(alpha: float, k: float, batch: int, cost: tuple[float, float] | list[float] | None,
                       draft_ratio: float = 0.0) -> tuple[float, float, float | None]:
    """(E, E / (1 + k·c), E / (verification cost + k·c)); c = a draft step over a target step."""
    tokens = leviathan_tokens(alpha, k)
    equal = tokens / (1.0 + k * draft_ratio)
    ratio = verify_cost_ratio(cost, batch, k)
    return tokens, equal, (tokens / (ratio + k * draft_ratio) if ratio else None)


# --- from raw rows to the report's rows ---------------------------------------------------------

def config_label(row: dict[str, Any]) -> str:
    if row["method"] == BASELINE:
        return BASELINE
    method = "draft" if row["method"] == "draft_model" else row["method"]
    return f"{method} adaptive<={row['k']}" if row.get("adaptive") else f"{method} k={row['k']}"


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(reference: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    """[request, first differing token] for every request whose tokens differ."""
    if len(reference) != len(outputs):
        return [[-1, -1]]
    return [[i, pos] for i, (a, b) in enumerate(zip(reference, outputs, strict=True))
            if (pos := _first_difference(a, b)) is not None]


def derive(raw: Iterable[dict[str, Any]], draft_ratios: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """The measured rows with speedups, α, predictions and the output check added.

    `raw`: the worker's rows (events skipped); `draft_ratios`: group -> draft step / target step."""
    rows = [dict(r) for r in raw if "event" not in r]
    baselines = {(r["group"], r["kind"], r["batch"]): r for r in rows if r["method"] == BASELINE and r.get("ok")}
    for row in rows:
        row["label"] = config_label(row)
        if not row.get("ok"):
            continue
        row["tok_s"] = row["output_tokens"] / row["wall_s"] if row["wall_s"] > 0 else None
        row["core_share"] = row["cpu_s"] / row["wall_s"] if row.get("cpu_s") and row["wall_s"] > 0 else None
        base = baselines.get((row["group"], row["kind"], row["batch"]))
        # Paired: the baseline's calls alternated with this row's; else its own pass.
        base_wall = row.get("base_wall_s") or (base["wall_s"] if base else None)
        base_cpu = row.get("base_cpu_s") or (base["cpu_s"] if base else None)
        row["speedup"] = base_wall / row["wall_s"] if base_wall and row["wall_s"] > 0 else None
        row["speedup_cpu"] = base_cpu / row["cpu_s"] if base_cpu and row.get("cpu_s") else None
        # The wall time split at each call's first token: the prompt (a draft model computes
        # its own KV of it too) and the decoding after it, where speculation works.
        first = row.get("first_token_s")
        base_first = row.get("base_first_token_s") or (base.get("first_token_s") if base else None)
        row["first_token_ratio"] = first / base_first if first and base_first else None
        decode, base_decode = (row["wall_s"] - first if first is not None else None,
                               base_wall - base_first if base_wall and base_first is not None else None)
        row["decode_speedup"] = base_decode / decode if decode and base_decode else None
        row["steps_ratio"] = base["steps"] / row["steps"] if base and base.get("steps") and row.get("steps") else None
        reference = row.get("base_outputs") or (base.get("outputs") if base else None)
        if reference is not None and "outputs" in row:
            row["mismatches"] = compare_outputs(reference, row["outputs"])
            row["identical"] = not row["mismatches"]
        else:
            row["identical"] = None
        if base is not None and base.get("outputs") is not None and row.get("base_outputs") is not None:
            # The baseline against itself, minutes apart: greedy decoding must repeat exactly.
            row["baseline_repeats"] = not compare_outputs(base["outputs"], row["base_outputs"])
        if row["method"] == BASELINE:
            continue
        spec = row.get("spec") or {}
        drafts, proposed, accepted = spec.get("num_drafts", 0), spec.get("num_draft_tokens", 0), spec.get(
            "num_accepted_tokens", 0)
        row["alpha"] = accepted / proposed if proposed else None
        row["mean_acceptance_length"] = 1.0 + accepted / drafts if drafts else None
        row["k_eff"] = proposed / drafts if drafts else None
        row["drafted_share"] = min(1.0, (drafts + accepted) / row["output_tokens"]) if row["output_tokens"] else None
        k = row["k_eff"] if row.get("adaptive") else row["k"]
        if row["alpha"] is not None and k:
            ratio = (draft_ratios or {}).get(row["group"], 0.0) if row["method"] in DRAFT_METHODS else 0.0
            tokens, equal, cost = predicted_speedups(row["alpha"], k, row["batch"], row.get("cost"), ratio)
            row.update(leviathan_tokens=tokens, pred_equal=equal, pred_cost=cost,
                       verify_cost_ratio=verify_cost_ratio(row.get("cost"), row["batch"], k))
    return rows


def kind_checks(rows: list[dict[str, Any]], conversations: dict[str, list[Any]]) -> dict[str, dict[str, list[int]]]:
    """group -> kind -> [answers of their kind, answers] over the baseline's largest cell."""
    from tandem.bench.spec_workloads import looks_like

    checks: dict[str, dict[str, list[int]]] = {}
    for row in rows:
        if row["method"] != BASELINE or not row.get("ok") or "texts" not in row:
            continue
        convs = conversations[row["kind"]]
        passed = sum(looks_like(row["kind"], c, t) for c, t in zip(convs, row["texts"], strict=False))
        current = checks.setdefault(row["group"], {}).get(row["kind"])
        if current is None or len(row["texts"]) > current[1]:
            checks[row["group"]][row["kind"]] = [passed, len(row["texts"])]
    return checks


# --- verdicts -----------------------------------------------------------------------------------

def _qualifies(row: dict[str, Any], goal: dict[str, Any], groups: dict[str, str]) -> bool:
    if row["method"] == BASELINE or row["kind"] != goal["kind"] or row["batch"] not in goal["batches"]:
        return False
    if goal["group"] is not None and row["group"] != groups.get(goal["group"]):
        return False
    if goal["methods"] is not None and row["method"] not in goal["methods"]:
        return False
    return goal["adaptive"] is None or bool(row.get("adaptive")) == goal["adaptive"]


def verdicts(rows: list[dict[str, Any]], groups: dict[str, str], draft_ratios: dict[str, float] | None = None,
             goals: Iterable[dict[str, Any]] = GOALS) -> list[dict[str, Any]]:
    """One verdict per goal: met, MISSED, not measured (nothing qualifying was asked for), or
    MISSED because what qualified did not run. `groups`: "main"/"draft" -> group name."""
    out = []
    for goal in goals:
        rows_for = [r for r in rows if _qualifies(r, goal, groups)]
        measured = [r for r in rows_for if r.get("ok") and r.get("speedup") is not None]
        verdict: dict[str, Any] = {"id": goal["id"], "goal": goal["text"], "bar": goal["bar"], "value": None}
        if goal["id"] == "draft-1.4x":
            ratio = (draft_ratios or {}).get(groups.get("draft", ""))
            verdict["draft_cost_ratio"] = ratio
        if not rows_for:
            verdict.update(status="not measured", detail="no configuration of this goal was in the run")
        elif not measured:
            errors = sorted({str(r.get("error")) for r in rows_for if not r.get("ok")})
            verdict.update(status="MISSED", detail="did not run: " + "; ".join(errors)[:400])
        elif goal["mode"] == "best":
            best = max(measured, key=lambda r: r["speedup"])
            verdict.update(value=best["speedup"], status="met" if best["speedup"] >= goal["bar"] else "MISSED",
                           detail=f"best: {best['label']} at batch {best['batch']}, {best['speedup']:.2f}x"
                                  + _cpu_note(best))
        else:
            worst = min(measured, key=lambda r: r["speedup"])
            missing = [b for b in goal["batches"] if not any(r["batch"] == b for r in measured)]
            status = "met" if worst["speedup"] >= goal["bar"] else "MISSED"
            detail = "; ".join(f"batch {r['batch']} {r['label']}: {r['speedup']:.2f}x{_cpu_note(r)}"
                               for r in sorted(measured, key=lambda r: (r["batch"], r["label"])))
            if missing and status == "met":
                status = "partly measured"
            if missing:
                detail += f"; batch {', '.join(map(str, missing))} not measured"
            verdict.update(value=worst["speedup"], status=status, detail=detail)
        if "draft_cost_ratio" in verdict and verdict["draft_cost_ratio"] is not None:
            verdict["detail"] += f"; draft step / target step = {verdict['draft_cost_ratio']:.3f}"
        different = [r for r in measured if r.get("identical") is False]
        if different:
            verdict["detail"] += f"; outputs differ from the baseline in {len(different)} of these rows"
        out.append(verdict)
    wrong = [r for r in rows if r.get("identical") is False]
    out.append({"id": "greedy-identical", "goal": "greedy outputs identical to no speculation",
                "status": "met" if not wrong else "MISSED", "bar": None, "value": len(wrong),
                "detail": "every measured row" if not wrong else "; ".join(
                    f"{r['label']} {r['kind']}@{r['batch']}: request {m[0]} from token {m[1]}"
                    for r in wrong for m in r["mismatches"][:1])})
    return out


def _cpu_note(row: dict[str, Any]) -> str:
    notes = []
    if row.get("speedup_cpu") is not None:
        notes.append(f"CPU time {row['speedup_cpu']:.2f}x")
    if row.get("decode_speedup") is not None:
        notes.append(f"after the first token {row['decode_speedup']:.2f}x")
    if row.get("first_token_ratio") is not None:
        notes.append(f"time to first token x{row['first_token_ratio']:.2f}")
    return f" ({'; '.join(notes)})" if notes else ""


def format_verdicts(items: list[dict[str, Any]]) -> str:
    marks = {"met": "✓ met", "MISSED": "✗ MISSED", "not measured": "- not measured", "partly measured": "~ partly"}
    return "\n".join(f"{marks.get(v['status'], v['status']):<16} {v['goal']}: {v['detail']}" for v in items)


# --- tables -------------------------------------------------------------------------------------

COLUMNS = ("config", "batch", "reqs", "time s", "base s", "tok/s", "speedup", "cpu x", "1st tok", "decode x", "α",
           "acc len", "k mean", "E(α,k)", "pred =", "pred cost", "steps x", "drafted", "same")


def _f(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def _cells(row: dict[str, Any]) -> list[str]:
    if not row.get("ok"):
        return [row["label"], str(row["batch"]), "-", "ERROR", *["-"] * (len(COLUMNS) - 4)]
    same = {True: "✓", False: "✗", None: "?"}[row.get("identical")]
    if row["method"] == BASELINE:
        same = ""
    return [row["label"], str(row["batch"]), str(row.get("requests", "-")), _f(row["wall_s"]),
            _f(row.get("base_wall_s")), _f(row.get("tok_s"), "{:.1f}"),
            _f(row.get("speedup"), "{:.2f}x"), _f(row.get("speedup_cpu"), "{:.2f}x"),
            _f(row.get("first_token_ratio"), "{:.2f}x"), _f(row.get("decode_speedup"), "{:.2f}x"), _f(row.get("alpha")),
            _f(row.get("mean_acceptance_length")), _f(row.get("k_eff"), "{:.1f}"),
            _f(row.get("leviathan_tokens")), _f(row.get("pred_equal"), "{:.2f}x"), _f(row.get("pred_cost"), "{:.2f}x"),
            _f(row.get("steps_ratio"), "{:.2f}x"), _f(row.get("drafted_share"), "{:.0%}"), same]


def _order(row: dict[str, Any]) -> tuple[Any, ...]:
    method_rank = 0 if row["method"] == BASELINE else 1
    return (row["batch"], method_rank, row["method"], bool(row.get("adaptive")), row.get("k") or 0)


def table_sections(rows: list[dict[str, Any]]) -> list[tuple[str, list[list[str]], list[str]]]:
    """(title, cell rows, error lines) per (group, kind), kinds in their usual order."""
    sections = []
    groups = list(dict.fromkeys(r["group"] for r in rows))
    for group in groups:
        model = next(r["model"] for r in rows if r["group"] == group)
        kinds = [k for k in KINDS if any(r["group"] == group and r["kind"] == k for r in rows)]
        for kind in kinds:
            mine = sorted((r for r in rows if r["group"] == group and r["kind"] == kind), key=_order)
            errors = [f"{r['label']} @ batch {r['batch']}: {r.get('error')}" for r in mine if not r.get("ok")]
            sections.append((f"{KIND_LABELS[kind]} — {model}", [_cells(r) for r in mine], errors))
    return sections


def format_tables(rows: list[dict[str, Any]], width: int = 200) -> str:
    """The tables as text: rich's when rich is installed, plain columns otherwise."""
    sections = table_sections(rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich comes with transformers' hub client, but is not ours to require
        return _plain_tables(sections)
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False)
    for title, cells, errors in sections:
        table = Table(title=title, title_justify="left")
        for i, column in enumerate(COLUMNS):
            table.add_column(column, justify="left" if i == 0 else "right", no_wrap=True)
        for row in cells:
            table.add_row(*row)
        console.print(table)
        for line in errors:
            console.print(f"  error: {line}", overflow="fold")
    return buffer.getvalue().rstrip()


def _plain_tables(sections: list[tuple[str, list[list[str]], list[str]]]) -> str:
    out = []
    for title, cells, errors in sections:
        widths = [max(len(r[i]) for r in [list(COLUMNS), *cells]) for i in range(len(COLUMNS))]

        def line(row: list[str], widths: list[int] = widths) -> str:
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

        out += [title, line(list(COLUMNS)), *(line(r) for r in cells), *(f"  error: {e}" for e in errors), ""]
    return "\n".join(out).rstrip()


# --- the hardware's bound -----------------------------------------------------------------------

def ceiling_lines(rows: list[dict[str, Any]], machine: dict[str, Any]) -> list[str]:
    """Output tok/s against the memory-bandwidth bound of plain decoding: a step of B
    requests reads every weight once, so B tokens take weight_bytes / bandwidth at best, the
    bandwidth being the memory traffic of the measured copy (it reads and writes each byte:
    2 x the copy rate). Attention's KV reads are left out (short contexts), so the bound is a
    little high at batch 1 and more so for large batches, where compute bounds the step too.
    Speculation can pass it: a step that verifies drafts yields more than one token per
    request for one read of the weights."""
    copy = machine.get("memory_bytes_per_s")
    if not copy:
        return ["memory bandwidth not measured"]
    bandwidth = 2 * copy
    lines = [f"memory copy {copy / 1e9:.1f} GB/s measured now, i.e. {bandwidth / 1e9:.1f} GB/s of traffic"]
    for group, info in (machine.get("groups") or {}).items():
        weights = info.get("weight_bytes")
        if not weights:
            lines.append(f"{group}: weight size unknown (model not found here)")
            continue
        lines.append(f"{group}: {weights / 1e6:.0f} MB of weights ({info.get('dtype')}) read per step")
        mine = [r for r in rows if r["group"] == group and r.get("ok") and r.get("tok_s")]
        for batch in sorted({r["batch"] for r in mine}):
            bound = batch * bandwidth / weights
            at = [r for r in mine if r["batch"] == batch]
            base = [r for r in at if r["method"] == BASELINE]
            spec = [r for r in at if r["method"] != BASELINE]
            text = f"  batch {batch}: plain decoding <= {bound:.1f} tok/s"
            if base:
                best = max(base, key=lambda r: r["tok_s"])
                text += f"; baseline best {best['tok_s']:.1f} tok/s ({best['kind']}, {best['tok_s'] / bound:.0%}{_per_cpu(best)})"
            if spec:
                best = max(spec, key=lambda r: r["tok_s"])
                text += (f"; best speculative {best['tok_s']:.1f} tok/s ({best['label']}, {best['kind']}, "
                         f"{best['tok_s'] / bound:.0%}{_per_cpu(best)})")
            lines.append(text)
    return lines


def _per_cpu(row: dict[str, Any]) -> str:
    """Tokens per CPU second: with one thread, the rate the process had while it ran, i.e.
    what an otherwise idle core would give."""
    if not row.get("cpu_s") or row.get("core_share", 1.0) > 0.95:
        return ""
    return f"; {row['output_tokens'] / row['cpu_s']:.1f} per CPU second"


# --- the chart ----------------------------------------------------------------------------------

def plot(rows: list[dict[str, Any]], group: str, path: Path, title: str = "") -> Path | None:
    """Speedup against k, a panel per (kind, batch): each method measured (solid), its
    cost-corrected Leviathan prediction (dashed), adaptive as a star at its mean k."""
    mine = [r for r in rows if r["group"] == group]
    kinds = [k for k in KINDS if any(r["kind"] == k for r in mine)]
    batches = sorted({r["batch"] for r in mine})
    if not kinds or not batches:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in mine if r["method"] != BASELINE))
    k_max = max([r.get("k") or 1 for r in mine] + [1])
    colors = dict(zip(methods, ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"], strict=False))
    fig, axes = plt.subplots(len(kinds), len(batches), figsize=(4.2 * len(batches), 3.2 * len(kinds)),
                             squeeze=False)
    for i, kind in enumerate(kinds):
        for j, batch in enumerate(batches):
            ax = axes[i][j]
            ax.axhline(1.0, color="#888", linewidth=0.8)
            cell = [r for r in mine if r["kind"] == kind and r["batch"] == batch and r.get("ok")]
            for method in methods:
                fixed = sorted((r for r in cell if r["method"] == method and not r.get("adaptive")
                                and r.get("speedup") is not None), key=lambda r: r["k"])
                if fixed:
                    ax.plot([r["k"] for r in fixed], [r["speedup"] for r in fixed], "o-", color=colors[method],
                            label=f"{method} measured")
                    predicted = [(r["k"], r["pred_cost"]) for r in fixed if r.get("pred_cost") is not None]
                    if predicted:
                        ax.plot(*zip(*predicted, strict=True), "x--", color=colors[method], alpha=0.7,
                                label=f"{method} Leviathan (fitted cost)")
                for r in cell:
                    if r["method"] == method and r.get("adaptive") and r.get("speedup") is not None:
                        ax.plot([r.get("k_eff") or 0.0], [r["speedup"]], "*", markersize=12, color=colors[method],
                                label=f"{method} adaptive")
            ax.set_xlim(0.0, k_max + 0.5)
            ax.set_title(f"{KIND_LABELS[kind]}, batch {batch}", fontsize=9)
            ax.set_xlabel("k (adaptive: mean k)", fontsize=8)
            ax.set_ylabel("speedup vs no speculation", fontsize=8)
            ax.grid(alpha=0.3)
            if not cell:
                ax.axis("off")  # e.g. batch 32, measured for prose alone
    handles, labels = [], []
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if handles:
        fig.legend(handles, labels, loc="lower center", ncols=min(4, len(labels)), fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def public_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for the JSON file: without the prompt and output tokens and the texts."""
    return [{k: v for k, v in r.items() if k not in ("outputs", "texts", "base_outputs", "prompt_token_ids")}
            for r in rows]
