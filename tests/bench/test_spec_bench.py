"""`tandem bench spec`: the Leviathan arithmetic, the report from a synthetic result set
(tables, JSON, chart, verdicts, a missed goal reported as missed), the plan, the requests,
and one tiny real run of the command on the default model."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.bench.spec import (
    add_spec_bench_parser,
    build_plans,
    build_report,
    draft_forwards,
    draft_ratios,
    make_cells,
    make_configs,
    parse_ints,
    parse_kind_batches,
    planned_cells,
    write_report,
)
from tandem.bench.spec_replay import read_outputs, replay
from tandem.bench.spec_report import (
    _cpu_note,
    compare_outputs,
    derive,
    format_tables,
    leviathan_tokens,
    predicted_speedups,
    verdicts,
    verify_cost_ratio,
)
from tandem.bench.spec_worker import cells_for, counters_increase, speculative_config
from tandem.bench.spec_workloads import KINDS, capacity, conversations, looks_like
from tandem.spec.ngram import NgramProposer

# --- the prediction -----------------------------------------------------------------------------


def test_leviathan_expected_tokens() -> None:
    assert leviathan_tokens(0.0, 4) == pytest.approx(1.0)  # nothing accepted: the target's own token
    assert leviathan_tokens(1.0, 4) == pytest.approx(5.0)  # everything accepted: k + 1
    assert leviathan_tokens(0.5, 1) == pytest.approx(1.5)
    assert leviathan_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)  # 3.3616
    assert leviathan_tokens(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert leviathan_tokens(0.6, 2.5) == pytest.approx((1 - 0.6 ** 3.5) / 0.4)  # an adaptive row's mean k
    with pytest.raises(ValueError):
        leviathan_tokens(1.2, 2)


def test_predictions_with_the_fitted_step_cost_and_a_draft_model() -> None:
    # A step over T tokens costs 1 + 0.1 T: at batch 1 with k = 4, verification costs 1.5 / 1.1.
    assert verify_cost_ratio((1.0, 0.1), 1, 4) == pytest.approx(1.5 / 1.1)
    assert verify_cost_ratio((1.0, 0.1), 8, 1) == pytest.approx(2.6 / 1.8)
    assert verify_cost_ratio(None, 1, 4) is None
    tokens, equal, cost = predicted_speedups(0.8, 4, 1, (1.0, 0.1))
    assert tokens == pytest.approx(3.3616)
    assert equal == pytest.approx(3.3616)
    assert cost == pytest.approx(3.3616 / (1.5 / 1.1))
    # A draft step costing a quarter of a target step: k of them per verification.
    tokens, equal, cost = predicted_speedups(0.8, 4, 1, (1.0, 0.0), draft_ratio=0.25)
    assert equal == pytest.approx(3.3616 / 2.0)
    assert cost == pytest.approx(3.3616 / 2.0)
    assert predicted_speedups(0.5, 2, 1, None)[2] is None


def test_output_comparison_finds_the_first_differing_token() -> None:
    assert compare_outputs([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == []
    assert compare_outputs([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == [[1, 1]]
    assert compare_outputs([[1, 2, 3]], [[1, 2]]) == [[0, 2]]  # stopped early
    assert compare_outputs([[1]], [[1], [2]]) == [[-1, -1]]


def test_counter_increase_per_cell() -> None:
    before = {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 4, "accepted_per_position": [3, 1]}
    after = {"num_drafts": 5, "num_draft_tokens": 15, "num_accepted_tokens": 9, "accepted_per_position": [5, 3, 1]}
    assert counters_increase(before, after) == {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 5,
                                                "accepted_per_position": [2, 2, 1]}


# --- a synthetic run -----------------------------------------------------------------------------

MAIN = "smollm2-135m"
DRAFT = "qwen2.5-coder-1.5b (draft qwen2.5-coder-0.5b)"


def _row(method: str, kind: str, batch: int, wall: float, k: int | None = None, adaptive: bool = False,
         outputs: list[list[int]] | None = None, spec: dict | None = None, group: str = MAIN, **extra) -> dict:
    outputs = outputs or [[1, 2, 3, 4]] * 2
    return {"group": group, "model": group.split(" ")[0], "config": f"{method}-{k}", "method": method, "k": k,
            "adaptive": adaptive, "kind": kind, "batch": batch, "ok": True, "wall_s": wall, "cpu_s": wall,
            "requests": len(outputs), "prompt_tokens": 100, "output_tokens": sum(map(len, outputs)),
            "outputs": outputs, "texts": ["x"] * len(outputs), "spec": spec or {}, "cost": [0.02, 0.001],
            "loadavg": [0.5, 0.7], **extra}


def synthetic(copy_wall: float = 4.0, prose_adaptive_32: float = 10.0, wrong: bool = False) -> list[dict]:
    spec4 = {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 30, "accepted_per_position": [9, 8, 7, 6]}
    spec_prose = {"num_drafts": 4, "num_draft_tokens": 4, "num_accepted_tokens": 0, "accepted_per_position": [0]}
    return [
        {"event": "step_time", "group": DRAFT, "config": "baseline", "decode_step_s": 0.2},
        {"event": "step_time", "group": DRAFT, "config": "draft-alone", "decode_step_s": 0.07},
        _row("baseline", "code", 1, 10.0, steps=30),
        _row("ngram", "code", 1, copy_wall, k=4, spec=spec4, steps=12,
             outputs=[[1, 2, 3, 4], [1, 2, 9, 9]] if wrong else None),
        _row("suffix", "code", 1, 0.0, k=4) | {"ok": False, "error": "ModuleNotFoundError: tandem.spec.suffix"},
        _row("baseline", "prose", 1, 10.0),
        _row("ngram", "prose", 1, 10.2, k=8, adaptive=True, spec=spec_prose),
        _row("baseline", "prose", 32, 10.0),
        _row("ngram", "prose", 32, prose_adaptive_32, k=8, adaptive=True, spec=spec_prose),
        _row("baseline", "tool", 1, 8.0, group=DRAFT),
        _row("draft_model", "tool", 1, 0.0, k=4, group=DRAFT) | {"ok": False, "error": "ValueError: not built"},
    ]


GROUPS = {"main": MAIN, "draft": DRAFT}


def test_derived_rows() -> None:
    ratios = draft_ratios({DRAFT: {"baseline": 0.2, "draft-alone": 0.07}})
    assert ratios == {DRAFT: pytest.approx(0.35)}
    # The draft's forward as the proposer timed it in the loop wins over the draft alone.
    forwards = draft_forwards([{"group": DRAFT, "draft_forward_s": 0.03}, {"group": DRAFT, "draft_forward_s": 0.05},
                               {"group": DRAFT, "draft_forward_s": 0.04}, {"group": MAIN, "draft_forward_s": None}])
    assert forwards == {DRAFT: pytest.approx(0.04)}
    assert draft_ratios({DRAFT: {"baseline": 0.2, "draft-alone": 0.07}}, forwards) == {DRAFT: pytest.approx(0.2)}
    rows = derive(synthetic(), ratios)
    ngram = next(r for r in rows if r["method"] == "ngram" and r["kind"] == "code")
    assert ngram["speedup"] == pytest.approx(2.5)
    assert ngram["alpha"] == pytest.approx(0.75)
    assert ngram["mean_acceptance_length"] == pytest.approx(4.0)
    assert ngram["k_eff"] == pytest.approx(4.0)
    assert ngram["leviathan_tokens"] == pytest.approx((1 - 0.75 ** 5) / 0.25)
    assert ngram["pred_cost"] == pytest.approx(ngram["leviathan_tokens"] / (0.025 / 0.021))
    assert ngram["identical"] is True
    assert ngram["tok_s"] == pytest.approx(8 / 4.0)
    assert ngram["steps_ratio"] == pytest.approx(30 / 12)
    prose = next(r for r in rows if r["method"] == "ngram" and r["kind"] == "prose" and r["batch"] == 1)
    assert prose["alpha"] == 0.0 and prose["leviathan_tokens"] == pytest.approx(1.0)
    assert prose["k_eff"] == pytest.approx(1.0)  # adaptive: one draft token per verification


def test_paired_rows_use_their_own_baseline_time_and_outputs() -> None:
    raw = synthetic()
    ngram = next(r for r in raw if r.get("method") == "ngram" and r["kind"] == "code")
    # The baseline's calls alternated with ngram's took 6 s this time (the machine got busier
    # after the first pass): the speedup is 6 / 4, not 10 / 4.
    ngram.update(base_wall_s=6.0, base_cpu_s=5.0, base_outputs=[[1, 2, 3, 4], [1, 2, 3, 5]])
    rows = derive(raw)
    row = next(r for r in rows if r["method"] == "ngram" and r["kind"] == "code")
    assert row["speedup"] == pytest.approx(1.5) and row["speedup_cpu"] == pytest.approx(1.25)
    # Compared with the paired baseline's outputs, which differ from the first pass's.
    assert row["identical"] is False and row["mismatches"] == [[1, 3]]
    assert row["baseline_repeats"] is False
    assert row["core_share"] == pytest.approx(1.0)


def test_wall_time_split_at_the_first_token() -> None:
    """A draft model's own prompt KV delays the first token; decoding after it is what
    speculation speeds up."""
    raw = synthetic()
    ngram = next(r for r in raw if r.get("method") == "ngram" and r["kind"] == "code")
    ngram.update(first_token_s=1.5, base_wall_s=6.0, base_first_token_s=1.0)
    row = next(r for r in derive(raw) if r["method"] == "ngram" and r["kind"] == "code")
    assert row["first_token_ratio"] == pytest.approx(1.5)
    assert row["decode_speedup"] == pytest.approx((6.0 - 1.0) / (4.0 - 1.5))
    assert "after the first token 2.00x" in _cpu_note(row)


def test_verdicts_met_missed_and_not_run() -> None:
    rows = derive(synthetic())
    by_id = {v["id"]: v for v in verdicts(rows, GROUPS)}
    assert by_id["copy-2x"]["status"] == "met"
    assert by_id["copy-2x"]["value"] == pytest.approx(2.5)
    assert by_id["draft-1.4x"]["status"] == "MISSED"
    assert "did not run" in by_id["draft-1.4x"]["detail"] and "not built" in by_id["draft-1.4x"]["detail"]
    assert by_id["adaptive-prose"]["status"] == "met"  # 10 / 10.2 = 0.98 at batch 1, 1.0 at 32
    assert by_id["greedy-identical"]["status"] == "met"


def test_a_failing_goal_is_reported_as_missed() -> None:
    rows = derive(synthetic(copy_wall=6.0, prose_adaptive_32=11.0, wrong=True))
    by_id = {v["id"]: v for v in verdicts(rows, GROUPS)}
    assert by_id["copy-2x"]["status"] == "MISSED"  # 10 / 6 = 1.67x
    assert by_id["copy-2x"]["value"] == pytest.approx(10 / 6)
    assert by_id["adaptive-prose"]["status"] == "MISSED"  # 10 / 11 = 0.91 at batch 32
    assert by_id["adaptive-prose"]["value"] == pytest.approx(10 / 11)
    assert by_id["greedy-identical"]["status"] == "MISSED"
    assert "request 1 from token 2" in by_id["greedy-identical"]["detail"]


def test_goals_not_in_the_run_and_half_measured() -> None:
    raw = [r for r in synthetic() if r.get("batch") != 32 and r.get("group") != DRAFT]
    by_id = {v["id"]: v for v in verdicts(derive(raw), {"main": MAIN})}
    assert by_id["draft-1.4x"]["status"] == "not measured"
    assert by_id["adaptive-prose"]["status"] == "partly measured"
    assert "batch 32 not measured" in by_id["adaptive-prose"]["detail"]


def test_report_files_from_a_synthetic_run(tmp_path: Path) -> None:
    plans = [{"role": "main", "group": MAIN, "model": MAIN, "conversations": {"code": conversations("code", 2)}},
             {"role": "draft", "group": DRAFT, "model": "qwen2.5-coder-1.5b",
              "conversations": {"tool": conversations("tool", 2)}}]
    machine = {"memory_bytes_per_s": 10e9, "groups": {MAIN: {"weight_bytes": 538e6, "dtype": "float32"},
                                                      DRAFT: {"weight_bytes": None, "dtype": "float32"}}}
    meta = {"dtype": "float32", "threads": 1, "max_tokens": 128, "single_prompts": 2, "wall_s": 61.0}
    text, report, rows = build_report(synthetic(wrong=True), plans, machine, {"cpu": "Test CPU", "cpu_count": 2}, meta)
    charts = write_report(tmp_path, text, report, rows, plans)
    assert [c.name for c in charts] == ["spec-main.png", "spec-draft.png"]
    assert all(c.stat().st_size > 1000 for c in charts)
    assert (tmp_path / "table.txt").read_text().startswith("tandem bench spec")
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["schema"] == "tandem.bench.spec/1"
    assert len(saved["rows"]) == 9 and all("outputs" not in r for r in saved["rows"])
    assert {v["id"]: v["status"] for v in saved["verdicts"]}["greedy-identical"] == "MISSED"
    assert saved["draft_ratios"] == {DRAFT: pytest.approx(0.35)}
    assert len((tmp_path / "outputs.jsonl").read_text().splitlines()) == 7
    for needle in ("code edits — smollm2-135m", "ngram k=4", "2.50x", "✗", "base s", "(CPU time 2.50x)", "steps x", "ERROR", "ModuleNotFoundError",
                   "✗ MISSED", "draft step / target step", "batch 1: plain decoding <= 37.2 tok/s",
                   "weight size unknown", "load average (1 min) during the cells: 0.5 to 0.7",
                   "baseline not re-run (unpaired)"):
        assert needle in text, needle


def test_plain_table_without_rich(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_rich(name: str, *args, **kwargs):
        if name.startswith("rich"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_rich)
    table = format_tables(derive(synthetic()))
    assert "code edits — smollm2-135m" in table and "ngram k=4" in table and "2.50x" in table


# --- the plan ------------------------------------------------------------------------------------

def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_spec_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["spec", *argv])


def test_number_lists_and_ranges() -> None:
    assert parse_ints("1-8", "--ks") == list(range(1, 9))
    assert parse_ints("1..3,8", "--ks") == [1, 2, 3, 8]
    assert parse_ints("4,2,2", "--ks") == [2, 4]
    for bad in ("0", "x", "5-2", "1-2-3"):
        with pytest.raises(ValueError):
            parse_ints(bad, "--ks", 1, 16)
    assert parse_kind_batches("prose:32,code:8") == [("prose", 32), ("code", 8)]
    with pytest.raises(ValueError):
        parse_kind_batches("poetry:32")


def test_default_plan() -> None:
    args = _args()
    assert args.threads == 1 and args.max_tokens == 128
    (plan,) = build_plans(args)  # no draft_model in the default methods
    names = [c["name"] for c in plan["configs"]]
    assert names == ["baseline", "ngram-k1", "ngram-k2", "ngram-k4", "ngram-k8", "ngram-adaptive8",
                     "suffix-k1", "suffix-k2", "suffix-k4", "suffix-k8", "suffix-adaptive8"]
    assert plan["engine_values"]["kv_cache_memory"] == "512MiB"
    # 6 cells for each configuration, and prose at batch 32 for the baseline and the adaptive ones.
    assert planned_cells(plan) == 11 * 6 + 3
    prose32 = [c for c in plan["cells"] if c["batch"] == 32]
    assert prose32 == [{"kind": "prose", "batch": 32, "requests": 32, "adaptive_only": True}]
    assert len(plan["conversations"]["prose"]) == 32 and len(plan["conversations"]["code"]) == 8
    assert speculative_config(plan["configs"][5]) == {"method": "ngram", "num_speculative_tokens": 8, "adaptive": True}
    assert speculative_config(plan["configs"][0]) is None


def test_draft_plan_and_refusals() -> None:
    plans = build_plans(_args("--methods", "ngram,draft", "--ks", "2", "--no-adaptive"))
    assert [p["role"] for p in plans] == ["main", "draft"]
    draft = plans[1]
    assert draft["model"] == "qwen2.5-coder-1.5b" and draft["cells"] == [{"kind": "tool", "batch": 1, "requests": 3}]
    assert [c["name"] for c in draft["configs"]] == ["baseline", "draft_model-k2", "draft-alone"]
    assert speculative_config(draft["configs"][1])["model"] == "qwen2.5-coder-0.5b"
    assert cells_for(draft["configs"][2], draft["cells"]) == []  # the draft alone: its step time only
    with pytest.raises(ValueError, match="unknown methods"):
        build_plans(_args("--methods", "medusa"))
    with pytest.raises(ValueError, match="speculative config"):
        build_plans(_args("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'))
    with pytest.raises(ValueError, match="distinct"):
        build_plans(_args("--batches", "64"))


def test_cells_and_configs() -> None:
    cells = make_cells(["code", "prose"], [1, 8], 3, [("prose", 32), ("code", 8)])
    assert len(cells) == 5 and cells[-1]["adaptive_only"] and cells[0]["requests"] == 3
    configs = make_configs(["ngram"], [2], True, 6)
    assert [len(cells_for(c, cells)) for c in configs] == [5, 4, 5]


# --- the requests --------------------------------------------------------------------------------

def test_requests_are_distinct_and_stable() -> None:
    for kind in KINDS:
        n = capacity(kind)
        assert n >= 40
        convs = conversations(kind, n)
        assert len({json.dumps(c) for c in convs}) == n
        assert conversations(kind, 8) == convs[:8]
        with pytest.raises(ValueError):
            conversations(kind, n + 1)


def test_answers_are_checked_for_their_kind() -> None:
    code = conversations("code", 1)[0]
    copied = "```python\nclass Counter:\n    def __init__(self):\n        self.total = 0\n```"
    assert looks_like("code", code, copied)
    assert not looks_like("code", code, "```python\nprint(1)\n```")
    tool = conversations("tool", 1)[0]
    assert looks_like("tool", tool, '{"name": "get_weather", "arguments": {"city": "Berlin"}}')
    assert not looks_like("tool", tool, "The weather in Berlin is sunny.")
    prose = conversations("prose", 1)[0]
    assert looks_like("prose", prose, "Once upon a time a keeper lived in a lighthouse by the grey sea.")
    assert not looks_like("prose", prose, copied)


# --- one real run --------------------------------------------------------------------------------

def test_tiny_real_run(tmp_path: Path) -> None:
    """The command on the default model: one kind, batch 1, k = 2, 16 tokens; a draft target
    that does not exist gives error rows and a missed goal, and the run goes on."""
    result = subprocess.run(
        [sys.executable, "-m", "tandem", "bench", "spec", "--methods", "ngram,draft", "--ks", "2", "--no-adaptive",
         "--kinds", "code", "--batches", "1", "--single-prompts", "1", "--max-tokens", "16",
         "--draft-target", str(tmp_path / "no-such-model"), "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    (report,) = tmp_path.glob("spec-*/results.json")
    saved = json.loads(report.read_text())
    rows = {(r["group"], r["label"]): r for r in saved["rows"]}
    base, ngram = rows[("smollm2-135m", "baseline")], rows[("smollm2-135m", "ngram k=2")]
    assert base["ok"] and ngram["ok"], (base.get("error"), ngram.get("error"))
    assert base["output_tokens"] == ngram["output_tokens"] == 16
    assert ngram["identical"] is True and ngram["mismatches"] == []
    assert ngram["spec"]["num_draft_tokens"] > 0 and ngram["alpha"] is not None
    assert ngram["speedup"] > 0 and ngram["pred_equal"] >= 1.0
    assert ngram["base_wall_s"] > 0 and ngram["baseline_repeats"] is True  # paired with the baseline
    # 16 tokens of decoding follow the first: it comes well before the end
    assert 0 < ngram["first_token_s"] < 0.8 * ngram["wall_s"] and ngram["decode_speedup"] > 0
    draft_rows = [r for r in saved["rows"] if r["method"] in ("baseline", "draft_model") and "no-such-model" in r["group"]]
    assert len(draft_rows) == 2 and not any(r["ok"] for r in draft_rows)
    assert all("FileNotFoundError" in r["error"] for r in draft_rows)
    statuses = {v["id"]: v["status"] for v in saved["verdicts"]}
    assert statuses["draft-1.4x"] == "MISSED" and statuses["greedy-identical"] == "met"
    assert "ngram k=2" in result.stdout and "goals:" in result.stdout
    assert (report.parent / "spec-main.png").is_file()
    # outputs.jsonl holds the prompts too: a replay of ngram over the baseline's answer counts
    # exactly the engine steps the run took with it.
    (recorded,) = read_outputs(report.parent / "outputs.jsonl")["code"]
    assert recorded.prompt and list(recorded.output) == ngram_outputs(report.parent)
    assert replay(NgramProposer(), [recorded], k=2, max_tokens=16).steps == ngram["steps"]


def ngram_outputs(run_dir: Path) -> list[int]:
    for line in (run_dir / "outputs.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["label"] == "ngram k=2":
            return row["outputs"][0]
    raise AssertionError("no ngram row in outputs.jsonl")


@pytest.mark.parametrize(("flags", "message"), [
    (["--methods", "ngram,oracle"], "unknown methods oracle"),
    (["--ks", "0-2"], "--ks must be in 1..16"),
    (["--speculative-config", '{"method": "ngram"}'], "sets the speculative config itself"),
])
def test_bad_plans_fail_at_parse_time(flags: list[str], message: str, tmp_path: Path, capsys) -> None:
    from tandem.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["bench", "spec", "--device", "cpu", *flags, "--output-dir", str(tmp_path / "out")])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("tandem: error: ") and message in line
    assert not (tmp_path / "out").exists()
