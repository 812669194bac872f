"""`tandem bench plan`'s pieces: the simulator gets the load client's own sessions and
arrival times, and measured figures come from the records as `tandem bench serve` keeps them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.bench.load_client import RequestRecord, RunResult, TrafficConfig, poisson_arrivals
from tandem.bench.plan import MIXES, errors, format_report, measured_figures, sim_workload
from tandem.bench.serve_workloads import build_serve_workload, make_sizer
from tandem.plan.pools.costs import CostModel


def test_simulated_sessions_are_the_ones_sent() -> None:
    mix = MIXES["agentic"]
    workload = build_serve_workload(mix.workload, make_sizer(None))
    sim = sim_workload(workload, mix.rate, seed=5)
    assert [s.arrival_s for s in sim.sessions] == poisson_arrivals(len(workload.sessions), mix.rate, 5)
    assert sim.system_tokens == workload.system_len > 0 and sim.message_overhead == 8
    for sent, simulated in zip(workload.sessions, sim.sessions, strict=True):
        assert [(t.prompt_len, t.max_tokens) for t in sent.turns] == [
            (t.new_tokens, t.output_tokens) for t in simulated.turns]
    one_turn = build_serve_workload(MIXES["output-heavy"].workload, make_sizer(None))
    assert sim_workload(one_turn, 1.0, 0).message_overhead == 0  # completions prompts, no template


def test_measured_figures_from_records() -> None:
    def record(ttft: float, e2e: float, tokens: int, ok: bool = True) -> RequestRecord:
        return RequestRecord("s", 0, "chat", tokens, 10, ttft_s=ttft, e2e_s=e2e, completion_tokens=tokens,
                             prompt_tokens=100, cached_tokens=50, error=None if ok else "boom")

    records = [record(0.1, 1.1, 11), record(0.3, 2.3, 21), record(0.2, 0.2, 1), record(9, 9, 2, ok=False)]
    result = RunResult("t", "http://x", "m", "w", TrafficConfig(request_rate=1), "now", 3.0, records)
    figures = measured_figures(result)
    assert figures["ttft_p50_s"] == pytest.approx(0.2) and figures["failed"] == 1
    assert figures["tpot_p50_s"] == pytest.approx(0.1) and figures["cached_ratio"] == pytest.approx(0.5)


def test_report_says_which_figures_are_within_the_goal() -> None:
    mix = {"measured": {"ttft_p50_s": 1.0, "ttft_p90_s": 2.0, "tpot_p50_s": 0.1, "tpot_p90_s": 0.2,
                        "requests": 4, "failed": 0, "prompt_tokens_mean": 100, "cached_ratio": 0.5},
           "predicted": {"ttft_p50_s": 1.1, "ttft_p90_s": 3.0, "tpot_p50_s": 0.1, "tpot_p90_s": 0.19,
                         "prompt_tokens_mean": 98, "cached_ratio": 0.45}}
    assert errors(mix)["ttft_p90_s"] == pytest.approx(0.5)
    text = format_report({"profile": "p.json", "profile_meta": {"machine": {"cpu": "CPU"}}, "layout": "1P+1D",
                          "threads": 1, "mixes": {"agentic": mix}})
    rows = [line for line in text.splitlines() if line.startswith("agentic")]
    assert [row.split()[-1] for row in rows] == ["yes", "NO", "yes", "yes"]


def test_a_tiny_real_run(tmp_path: Path) -> None:
    """A real 1P+1D cluster serves a few output-heavy requests; the report holds both sides."""
    CostModel(0.04, 0.002, 0.002, 8e-7, 2e-6, 0.0, transfer_s_per_token=4e-6, transfer_fixed_s=0.001,
              http_overhead_s=0.001, meta={"machine": {"cpu": "test"}, "max_num_batched_tokens": 2048}
              ).save(tmp_path / "profile.json")
    result = subprocess.run(
        [sys.executable, "-m", "tandem", "bench", "plan", "--profile", str(tmp_path / "profile.json"),
         "--mixes", "output-heavy", "--size-scale", "0.15", "--rate-scale", "3", "--kv-cache-memory", "256MiB",
         "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    mix = report["mixes"]["output-heavy"]
    assert mix["measured"]["requests"] == 4 and mix["measured"]["failed"] == 0
    for side in ("measured", "predicted"):
        assert all(0 < mix[side][key] < 60 for key in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s"))
    assert "output-heavy   TTFT p50" in result.stdout and (tmp_path / "out" / "plan.png").is_file()


def test_an_unknown_mix_fails_at_parse_time(tmp_path: Path, capsys) -> None:
    from tandem.cli.main import main

    out = tmp_path / "plan"
    with pytest.raises(SystemExit) as exited:
        main(["bench", "plan", "--profile", str(tmp_path / "costs.json"), "--mixes", "agentic,bursty",
              "--out", str(out)])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("tandem: error: unknown mix bursty; choose from")
    assert not out.exists()
