"""The load client against a live `tandem serve` (the ``tandem_server`` fixture of
tests/conftest.py: the base URL of a running server on the default model)."""

from __future__ import annotations

from tandem.bench.load_client import RequestRecord, RunResult, TrafficConfig, run_load
from tandem.bench.serve_report import TargetOutcome, compute_metrics, split_by_protocol
from tandem.bench.serve_workloads import (
    WordSizer,
    WorkloadConfig,
    build_serve_workload,
    interleave_protocols,
    warmup_turn,
)


def _check_every_request(result: RunResult) -> None:
    assert result.records, "no requests ran"
    errors = [(r.session_id, r.turn, r.error) for r in result.records if not r.ok]
    assert not errors and result.skipped_requests == 0
    for record in result.records:
        assert record.ttft_s is not None and record.ttft_s > 0
        assert record.e2e_s is not None and record.e2e_s >= record.ttft_s
        # ignore_eos: every request runs to max_tokens
        assert record.usage_reported and record.completion_tokens == record.max_tokens
        assert record.finish_reason == "length" and record.output_text
        # one gap per streamed chunk after the first; a chunk carries one token or more
        assert len(record.itl_s) == record.output_chunks - 1 <= record.max_tokens - 1
        assert record.prompt_tokens is not None and record.cached_tokens is not None
        # the server counts whole 16-token blocks, and always computes the last prompt token
        assert record.cached_tokens % 16 == 0 and record.cached_tokens < record.prompt_tokens


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
        TrafficConfig(concurrency=2, session_header=True),
        target="tandem",
        warmup=[warmup_turn(WordSizer())],
    )
    assert len(result.records) == 4
    _check_every_request(result)
    assert {r.endpoint for r in result.records} == {"chat"}
    # turn 2 re-sends turn 1's whole conversation: the server finds at least all of turn 1's
    # prompt (its whole blocks) in its prefix cache
    second = [r for r in result.records if r.turn == 1]
    first = {r.session_id: r for r in result.records if r.turn == 0}
    for record in second:
        before = first[record.session_id].prompt_tokens
        assert before is not None and record.prompt_tokens > before  # type: ignore[operator]
        assert record.cached_tokens >= before // 16 * 16 > 0  # type: ignore[operator]
    metrics = compute_metrics(result)
    assert (metrics["requests"], metrics["completed"], metrics["errors"]) == (4, 4, 0)
    assert metrics["completion_tokens"] == 4 * 6
    assert metrics["prompt_tokens"] == sum(r.prompt_tokens for r in result.records)  # type: ignore[misc]
    assert metrics["cached_tokens"] == sum(r.cached_tokens for r in result.records)  # type: ignore[misc]
    assert metrics["cached_ratio"] == metrics["cached_tokens"] / metrics["prompt_tokens"]
    assert metrics["output_tok_s"] == 24 / result.duration_s


def test_fixed_requests_against_tandem(tandem_server: str) -> None:
    workload = build_serve_workload(
        WorkloadConfig(name="fixed", num_requests=3, input_len=24, output_len=5)
    )
    result = run_load(tandem_server, workload, TrafficConfig(concurrency=2, warmup_requests=0))
    assert len(result.records) == 3
    _check_every_request(result)
    assert {r.endpoint for r in result.records} == {"completions"}
    assert all(len(r.itl_s) >= 1 for r in result.records)  # streamed: 5 tokens, 2 chunks or more


def test_interleaved_protocols_against_tandem(tandem_server: str) -> None:
    """`--protocol chat,messages,responses --interleave-protocols`: each session once per
    protocol in one run. The copies cost the server the same work (the adapters render the same
    prompt, and each generates the same number of tokens), and each protocol caches its own
    prefixes (its `cache_salt`) as a run of it alone would."""
    protocols = ["chat", "messages", "responses"]
    config = WorkloadConfig(name="agentic", num_sessions=2, turns_min=2, turns_max=2, prefix_len=96,
                            user_len_min=16, user_len_max=24, agentic_output_len=6)
    workload = interleave_protocols(build_serve_workload(config), protocols)
    result = run_load(tandem_server, workload, TrafficConfig(concurrency=3, warmup_requests=0), target="tandem")
    assert len(result.records) == 12
    _check_every_request(result)
    by_turn: dict[tuple[str, int], dict[str, RequestRecord]] = {}
    for record in result.records:
        session = record.session_id.rsplit("-", 1)[0]
        by_turn.setdefault((session, record.turn), {})[record.protocol] = record
    assert len(by_turn) == 4
    for (session, index), turn in by_turn.items():
        assert set(turn) == set(protocols)
        assert {r.completion_tokens for r in turn.values()} == {6}
        earlier = [by_turn[(session, i)] for i in range(index)]
        if all(len({r.output_text for r in t.values()}) == 1 for t in earlier):  # the same history
            assert len({r.prompt_tokens for r in turn.values()}) == 1, {p: r.prompt_tokens for p, r in turn.items()}
    for key, turn in by_turn.items():  # a later turn finds its own protocol's earlier turn
        if key[1] == 1:
            for protocol, record in turn.items():
                before = by_turn[(key[0], 0)][protocol].prompt_tokens
                assert record.cached_tokens >= before // 16 * 16 > 0, protocol  # type: ignore[operator]
    outcome = TargetOutcome("tandem", tandem_server, result=result)
    parts = split_by_protocol(outcome, protocols, workload.system_len)
    assert [p.name for p in parts] == ["tandem", "tandem+messages", "tandem+responses"]
    assert [p.metrics["requests"] for p in parts] == [4, 4, 4]
    assert all(p.metrics["output_tok_s"] == 24 / result.duration_s for p in parts)
