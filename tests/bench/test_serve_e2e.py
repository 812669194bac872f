"""The load client against a live `tandem serve` (the ``tandem_server`` fixture of
tests/conftest.py: the base URL of a running server on the default model)."""

from __future__ import annotations

from tandem.bench.load_client import LoadConfig, RunResult, run_load
from tandem.bench.serve_report import compute_metrics
from tandem.bench.serve_workloads import (
    WordSizer,
    WorkloadConfig,
    build_serve_workload,
    warmup_turn,
)


def _check_every_request(result: RunResult) -> None:
    assert result.records, "no requests ran"
    errors = [(r.session_id, r.turn, r.error) for r in result.records if not r.ok]
    assert not errors and result.skipped_requests == 0
    for record in result.records:
        assert record.ttft_s is not None and record.ttft_s > 0
        assert record.e2e_s is not None and record.e2e_s >= record.ttft_s
        assert record.usage_reported and record.completion_tokens == record.max_tokens
        assert record.prompt_tokens and record.prompt_tokens > 0
        assert len(record.itl_s) <= record.max_tokens - 1


def test_agentic_sessions_against_tandem(tandem_server: str) -> None:
    config = WorkloadConfig(
        name="agentic",
        num_sessions=2,
        turns_min=2,
        turns_max=2,
        prefix_len=96,
        user_len_min=16,
        user_len_max=24,
        agentic_output_len=6,
    )
    workload = build_serve_workload(config)
    result = run_load(
        tandem_server,
        workload,
        LoadConfig(concurrency=2, session_header=True),
        target="tandem",
        warmup=[warmup_turn(WordSizer())],
    )
    assert len(result.records) == 4
    _check_every_request(result)
    assert {r.endpoint for r in result.records} == {"chat"}
    # turn 2 re-sends turn 1's whole conversation: the server must find it in its prefix cache
    second = [r for r in result.records if r.turn == 1]
    assert all((r.cached_tokens or 0) > 0 for r in second)
    first = {r.session_id: r for r in result.records if r.turn == 0}
    assert all(r.prompt_tokens > first[r.session_id].prompt_tokens for r in second)  # type: ignore[operator]
    metrics = compute_metrics(result)
    assert metrics["errors"] == 0 and metrics["cached_ratio"] > 0 and metrics["output_tok_s"] > 0


def test_fixed_requests_against_tandem(tandem_server: str) -> None:
    workload = build_serve_workload(
        WorkloadConfig(name="fixed", num_requests=3, input_len=24, output_len=5)
    )
    result = run_load(tandem_server, workload, LoadConfig(concurrency=2, warmup_requests=0))
    assert len(result.records) == 3
    _check_every_request(result)
    assert {r.endpoint for r in result.records} == {"completions"}
    assert all(len(r.itl_s) >= 1 for r in result.records)
