"""`tandem bench plan`'s pieces: the simulator gets the load client's own sessions and
arrival times, and measured figures come from the records as `tandem bench serve` keeps them."""

from __future__ import annotations

import pytest

from tandem.bench.load_client import LoadConfig, RequestRecord, RunResult, poisson_arrivals
from tandem.bench.plan import MIXES, errors, format_report, measured_figures, sim_workload
from tandem.bench.serve_workloads import build_serve_workload, make_sizer


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
    result = RunResult("t", "http://x", "m", "w", LoadConfig(request_rate=1), "now", 3.0, records)
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
