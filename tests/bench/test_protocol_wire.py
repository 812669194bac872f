"""`tandem bench serve --protocol`: each protocol's request and stream read into one meter.

The streams here are written out by hand in each protocol's documented event sequence; the
same meter reads a real server's streams in tests/bench/test_serve_e2e.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.bench.load_client import RequestRecord, StreamMeter
from tandem.bench.protocol_wire import request_body
from tandem.bench.serve import Target, parse_protocols, protocol_goal_lines, with_protocols
from tandem.bench.serve_report import TargetOutcome, format_table

HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]


def _event(name: str, payload: dict[str, Any]) -> list[str]:
    return [f"event: {name}", f"data: {json.dumps(payload)}", ""]


def _read(protocol: str, lines: list[tuple[float, str]]) -> tuple[RequestRecord, bool]:
    meter = StreamMeter(0.0, protocol)
    ended = False
    for now, line in lines:
        ended = meter.feed(line, now)
        if ended:
            break
    record = RequestRecord("s", 0, "chat", max_tokens=3, new_prompt_len=2)
    meter.fill(record, 3.0)
    return record, ended


def test_request_bodies_carry_the_same_conversation() -> None:
    chat = request_body("chat", "m", HISTORY, 7, 0.0, True)
    assert chat["messages"] == HISTORY and chat["stream_options"] == {"include_usage": True}
    messages = request_body("messages", "m", HISTORY, 7, 0.0, True)
    assert messages["system"] == "Be brief." and messages["messages"] == HISTORY[1:]
    assert messages["max_tokens"] == 7 and messages["ignore_eos"] is True
    responses = request_body("responses", "m", HISTORY, 7, 0.0, False)
    assert responses["instructions"] == "Be brief." and responses["input"] == HISTORY[1:]
    assert responses["max_output_tokens"] == 7 and "ignore_eos" not in responses and responses["store"] is False


def test_a_messages_stream_is_timed_and_its_usage_read() -> None:
    usage = {"input_tokens": 4, "cache_read_input_tokens": 16, "cache_creation_input_tokens": 2, "output_tokens": 3}
    lines = [(0.1, line) for line in _event("message_start", {"type": "message_start", "message": {}})]
    lines += [(0.1, line) for line in _event("ping", {"type": "ping"})]
    lines += [(1.0, line) for line in _event("content_block_delta", {
        "type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}})]
    lines += [(1.5, line) for line in _event("content_block_delta", {
        "type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo"}})]
    lines += [(1.6, line) for line in _event("message_delta", {
        "type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": usage})]
    lines += [(1.7, line) for line in _event("message_stop", {"type": "message_stop"})]
    record, ended = _read("messages", lines)
    assert ended and record.ok
    assert record.ttft_s == pytest.approx(1.0) and record.itl_s == pytest.approx([0.5])
    assert record.output_text == "Hello" and record.finish_reason == "length"
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (22, 3, 16)


def test_a_responses_stream_is_timed_and_its_usage_read() -> None:
    usage = {"input_tokens": 22, "input_tokens_details": {"cached_tokens": 16}, "output_tokens": 3}
    lines = [(0.1, line) for line in _event("response.created", {"type": "response.created", "response": {}})]
    lines += [(1.0, line) for line in _event("response.output_text.delta", {
        "type": "response.output_text.delta", "delta": "Hel"})]
    lines += [(1.25, line) for line in _event("response.function_call_arguments.delta", {
        "type": "response.function_call_arguments.delta", "delta": "{}"})]
    lines += [(1.5, line) for line in _event("response.completed", {
        "type": "response.completed", "response": {"usage": usage}})]
    record, ended = _read("responses", lines)
    assert ended and record.ok
    assert record.ttft_s == pytest.approx(1.0) and record.output_text == "Hel{}"
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (22, 3, 16)


@pytest.mark.parametrize(("protocol", "payload", "message"), [
    ("messages", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}, "busy"),
    ("responses", {"type": "response.failed", "response": {"error": {"message": "engine died"}}}, "engine died"),
])
def test_an_error_event_ends_the_stream_as_an_error(protocol: str, payload: dict[str, Any], message: str) -> None:
    record, ended = _read(protocol, [(0.5, f"data: {json.dumps(payload)}")])
    assert ended and record.error == message


def test_a_stream_cut_before_its_last_event_is_an_error() -> None:
    lines = [(1.0, line) for line in _event("content_block_delta", {
        "type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}})]
    record, ended = _read("messages", lines)
    assert not ended and record.error is not None and "ended before" in record.error


def test_targets_run_once_per_protocol_chat_first() -> None:
    assert parse_protocols("responses, chat") == ["chat", "responses"]
    with pytest.raises(ValueError, match="choose from"):
        parse_protocols("grpc")
    names = [t.name for t in with_protocols([Target("colocated", launch="colocated")], ["chat", "messages"])]
    assert names == ["colocated", "colocated+messages"]


def _outcome(name: str, ttft: float, tok_s: float, cached: float) -> TargetOutcome:
    from tandem.bench.load_client import RunResult, TrafficConfig

    result = RunResult(name, "", "m", "agentic", TrafficConfig(concurrency=1), "", 1.0, [])
    return TargetOutcome(name, "", result=result,
                         metrics={"ttft_p50_ms": ttft, "output_tok_s": tok_s, "cached_pct": cached})


def test_the_protocol_goal_holds_each_protocol_to_chat_within_three_percent() -> None:
    targets = with_protocols([Target("pd", launch="pd")], ["chat", "messages", "responses"])
    outcomes = [_outcome("pd", 100.0, 50.0, 90.0), _outcome("pd+messages", 102.0, 49.0, 90.0),
                _outcome("pd+responses", 104.0, 50.0, 90.0)]
    lines = protocol_goal_lines(outcomes, targets)
    assert len(lines) == 2
    assert lines[0].startswith("goal (messages vs chat on pd)") and lines[0].endswith(": met")
    assert lines[1].startswith("goal (responses vs chat on pd)") and lines[1].endswith("NOT met")


def test_an_interleaved_run_holds_each_protocol_to_chats_rate_per_stream() -> None:
    """Interleaved protocols share one run's wall time, so their output tok/s are equal by
    construction; the goal reads each protocol's tokens over its own requests' time."""
    targets = with_protocols([Target("pd", launch="pd")], ["chat", "messages", "responses"])
    outcomes = [_outcome("pd", 100.0, 50.0, 90.0), _outcome("pd+messages", 101.0, 50.0, 90.0),
                _outcome("pd+responses", 100.0, 50.0, 90.0)]
    for outcome, per_stream in zip(outcomes, (8.0, 7.9, 7.6), strict=True):
        outcome.metrics.update(stream_tok_s=per_stream, interleaved=True)
    messages, responses = protocol_goal_lines(outcomes, targets)
    assert "output tok/s per stream 7.90 vs 8.00 (-1.2%)" in messages and messages.endswith(": met")
    assert "(-5.0%)" in responses and responses.endswith("NOT met")
    table = format_table(outcomes)
    assert "output tok/s per stream" in table
    assert "output tok/s per stream" not in format_table([_outcome("a", 1.0, 1.0, 1.0), _outcome("b", 1.0, 1.0, 1.0)])


@pytest.mark.parametrize(("flags", "message"), [
    (["--interleave-protocols"], "--interleave-protocols needs two or more --protocol"),
    (["--protocol", "grpc"], "--protocol 'grpc': choose from"),
])
def test_protocol_flags_are_checked_before_anything_starts(flags: list[str], message: str) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tandem", "bench", "serve", "--launch", "pd", *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"tandem: error: {message}" in done.stderr


def test_a_lone_launched_server_gets_no_cluster_secret_and_a_cluster_does(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """With a cluster secret a worker answers only signed requests, and the load client signs
    none: `--launch tandem` got 401s on every request while it was given one."""
    import argparse

    from tandem.bench.serve import LaunchContext, add_serve_parser, build_server
    from tandem.trust.keys import CLUSTER_SECRET_ENV

    monkeypatch.setenv(CLUSTER_SECRET_ENV, "from-the-shell")
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--launch", "tandem,colocated"])
    lone = build_server(Target("tandem", launch="tandem"), args, LaunchContext(), tmp_path)
    assert CLUSTER_SECRET_ENV not in lone.env
    cluster = build_server(Target("colocated", launch="colocated"), args, LaunchContext(), tmp_path)
    assert cluster.env[CLUSTER_SECRET_ENV] == "from-the-shell"
