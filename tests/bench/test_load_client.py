"""The load client: SSE parsing and timing (StreamMeter), and whole runs against a fake
OpenAI server behind ``httpx.MockTransport`` (history growth, headers, errors, load modes)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tandem.bench.load_client import (
    RequestRecord,
    StreamMeter,
    TrafficConfig,
    poisson_arrivals,
    resolve_endpoint,
    run_load,
)
from tandem.bench.serve_workloads import Turn, WorkloadConfig, build_serve_workload


def _chunk(
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    usage: dict[str, Any] | None = None,
    text: str | None = None,
) -> str:
    choices = []
    if delta is not None:
        choices.append({"index": 0, "delta": delta, "finish_reason": finish})
    if text is not None:
        choices.append({"index": 0, "text": text, "finish_reason": finish})
    body: dict[str, Any] = {"id": "x", "object": "chat.completion.chunk", "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return "data: " + json.dumps(body)


def _record() -> RequestRecord:
    return RequestRecord("s", 0, "chat", max_tokens=3, new_prompt_len=10)


# --- StreamMeter ---------------------------------------------------------------------------


def test_meter_ttft_skips_role_chunk_and_itl_are_gaps() -> None:
    meter = StreamMeter(start=100.0)
    lines = [
        (100.5, _chunk({"role": "assistant", "content": ""})),
        (100.5, ""),
        (101.0, _chunk({"content": "Hello"})),
        (101.0, ": keep-alive comment"),
        (101.25, _chunk({"content": " wor"})),
        (101.75, _chunk({"content": "ld"}, finish="length")),
        (
            101.8,
            _chunk(
                usage={
                    "prompt_tokens": 12,
                    "completion_tokens": 3,
                    "prompt_tokens_details": {"cached_tokens": 8},
                }
            ),
        ),
    ]
    for now, line in lines:
        assert not meter.feed(line, now)
    assert meter.feed("data: [DONE]", 102.0)
    record = _record()
    meter.fill(record, 102.0)
    assert record.ok
    assert record.ttft_s == pytest.approx(1.0)
    assert record.itl_s == pytest.approx([0.25, 0.5])
    assert record.e2e_s == pytest.approx(2.0)
    assert record.output_text == "Hello world" and record.output_chunks == 3
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (12, 3, 8)
    assert record.usage_reported and record.finish_reason == "length"


def test_meter_completions_text_and_tool_calls_count_as_output() -> None:
    meter = StreamMeter(0.0)
    meter.feed("data:" + _chunk(text="abc")[5:], 1.0)  # no space after "data:"
    meter.feed(
        _chunk({"tool_calls": [{"index": 0, "function": {"name": "read_file", "arguments": ""}}]}),
        2.0,
    )
    meter.feed(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}), 3.0)
    meter.feed("data: [DONE]", 3.5)
    record = _record()
    meter.fill(record, 3.5)
    assert record.ttft_s == 1.0 and record.itl_s == [1.0, 1.0]
    assert record.output_text == "abcread_file{}"


def test_meter_missing_cached_tokens_and_usage() -> None:
    for usage in (
        {"prompt_tokens": 5, "completion_tokens": 2},
        {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None},
    ):
        meter = StreamMeter(0.0)
        meter.feed(_chunk({"content": "a"}), 1.0)
        meter.feed(_chunk(usage=usage), 1.0)
        meter.feed("data: [DONE]", 1.0)
        record = _record()
        meter.fill(record, 1.0)
        assert record.ok and record.cached_tokens is None and record.prompt_tokens == 5
    meter = StreamMeter(0.0)
    meter.feed(_chunk({"content": "a"}), 1.0)
    meter.feed("data: [DONE]", 1.0)
    record = _record()
    meter.fill(record, 1.0)
    assert record.ok and not record.usage_reported and record.completion_tokens is None


def test_meter_errors() -> None:
    cases = {
        "stream ended before": [_chunk({"content": "a"})],
        "boom": [_chunk({"content": "a"}), 'data: {"error": {"message": "boom", "type": "x"}}'],
        "bad SSE data": ["data: {not json"],
        "no output": [
            _chunk({"role": "assistant"}),
            _chunk(usage={"completion_tokens": 0}),
            "data: [DONE]",
        ],
    }
    for expected, lines in cases.items():
        meter = StreamMeter(0.0)
        for i, line in enumerate(lines):
            if meter.feed(line, float(i)):
                break
        record = _record()
        meter.fill(record, 5.0)
        assert not record.ok and expected in (record.error or ""), (expected, record.error)


def test_poisson_arrivals_seeded() -> None:
    a = poisson_arrivals(200, rate=4.0, seed=3)
    assert a == poisson_arrivals(200, rate=4.0, seed=3) != poisson_arrivals(200, rate=4.0, seed=4)
    assert a[0] == 0.0 and a == sorted(a)
    assert 200 / 4.0 * 0.7 < a[-1] < 200 / 4.0 * 1.3


def test_traffic_config_validation_and_endpoint() -> None:
    for bad in (
        TrafficConfig(),
        TrafficConfig(concurrency=2, request_rate=1.0),
        TrafficConfig(concurrency=0),
        TrafficConfig(request_rate=0.0),
        TrafficConfig(concurrency=1, endpoint="x"),
    ):
        with pytest.raises(ValueError):
            bad.validate()
    agentic = build_serve_workload(
        WorkloadConfig(
            name="agentic",
            num_sessions=1,
            turns_min=1,
            turns_max=1,
            prefix_len=20,
            user_len_min=5,
            user_len_max=5,
        )
    )
    fixed = build_serve_workload(WorkloadConfig(name="fixed", num_requests=1, input_len=5))
    assert (
        resolve_endpoint("auto", agentic) == "chat"
        and resolve_endpoint("auto", fixed) == "completions"
    )
    assert resolve_endpoint("chat", fixed) == "chat"
    with pytest.raises(ValueError):
        resolve_endpoint("completions", agentic)


# --- whole runs against a fake server ------------------------------------------------------


class FakeServer:
    """An OpenAI-style streaming server in-process: one output chunk per token, usage at the
    end, cached tokens = the longest prompt prefix (in characters / 4) seen before."""

    def __init__(
        self,
        fail_when: str | None = None,
        delay_s: float = 0.001,
        report_cached: bool = True,
        raise_when: str | None = None,
    ) -> None:
        self.requests: list[dict[str, Any]] = []
        self.headers: list[httpx.Headers] = []
        self.fail_when = fail_when
        self.raise_when = raise_when
        self.delay_s = delay_s
        self.report_cached = report_cached
        self.seen: list[str] = []
        # (x-session-affinity, messages sent, cached_tokens reported) of each chat request
        self.reported: list[tuple[str | None, int, int]] = []

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        self.requests.append(body)
        self.headers.append(request.headers)
        prompt = json.dumps(body.get("messages")) if "messages" in body else body["prompt"]
        if self.raise_when and self.raise_when in prompt:
            raise httpx.ConnectError("connection refused")
        if self.fail_when and self.fail_when in prompt:
            return httpx.Response(
                400, json={"error": {"message": "too long", "type": "invalid_request_error"}}
            )
        cached = max((_common(prompt, p) for p in self.seen), default=0) // 4
        self.seen.append(prompt)
        if "messages" in body:
            self.reported.append(
                (request.headers.get("x-session-affinity"), len(body["messages"]), cached)
            )
        return httpx.Response(
            200,
            content=self.stream(body, len(prompt) // 4, cached),
            headers={"content-type": "text/event-stream"},
        )

    async def stream(
        self, body: dict[str, Any], prompt_tokens: int, cached: int
    ) -> AsyncIterator[bytes]:
        chat = "messages" in body
        if chat:
            yield (_chunk({"role": "assistant", "content": ""}) + "\n\n").encode()
        for i in range(body["max_tokens"]):
            await asyncio.sleep(self.delay_s)
            piece = f" t{i}"
            line = _chunk({"content": piece}) if chat else _chunk(text=piece)
            yield (line + "\n\n").encode()
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": body["max_tokens"],
            "total_tokens": prompt_tokens + body["max_tokens"],
        }
        if self.report_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        yield (_chunk(usage=usage) + "\n\ndata: [DONE]\n\n").encode()


def _common(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


AGENTIC = WorkloadConfig(
    name="agentic",
    num_sessions=3,
    turns_min=3,
    turns_max=3,
    prefix_len=60,
    user_len_min=8,
    user_len_max=12,
    agentic_output_len=4,
)


def test_agentic_run_resends_history_with_actual_replies() -> None:
    server = FakeServer()
    workload = build_serve_workload(AGENTIC)
    seen: list[RequestRecord] = []
    config = TrafficConfig(concurrency=2, session_header=True, api_key="secret", warmup_requests=1)
    warm = Turn("warm up", 2, 2)
    result = run_load(
        "http://fake",
        workload,
        config,
        target="fake",
        warmup=[warm],
        on_record=seen.append,
        transport=server.transport(),
    )
    assert result.model == "fake-model" and result.server_models == ["fake-model"]
    assert len(result.records) == 9 == len(seen) and result.skipped_requests == 0
    assert all(
        r.ok and r.ttft_s and r.ttft_s > 0 and r.completion_tokens == 4 for r in result.records
    )
    # the warm-up went first, without the shared system prompt, and is not recorded
    assert server.requests[0]["messages"] == [{"role": "user", "content": "warm up"}]
    for body in server.requests:
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        assert (
            body["ignore_eos"] is True
            and body["temperature"] == 0.0
            and body["model"] == "fake-model"
        )
    assert all(h["authorization"] == "Bearer secret" for h in server.headers)
    by_session: dict[str, list[dict[str, Any]]] = {}
    for body, headers in zip(server.requests[1:], server.headers[1:], strict=True):
        by_session.setdefault(headers["x-session-affinity"], []).append(body)
    assert sorted(by_session) == [s.session_id for s in workload.sessions]
    for session in workload.sessions:
        bodies = by_session[session.session_id]
        assert [len(b["messages"]) for b in bodies] == [2, 4, 6]
        last = bodies[-1]["messages"]
        assert last[0] == {"role": "system", "content": workload.system}
        assert [m["content"] for m in last if m["role"] == "user"] == [
            t.prompt for t in session.turns
        ]
        assert [m["content"] for m in last if m["role"] == "assistant"] == [" t0 t1 t2 t3"] * 2
    # each record carries the cached_tokens the server reported for that very request
    reported = {(session, count): cached for session, count, cached in server.reported}
    for record in result.records:
        assert record.cached_tokens == reported[(record.session_id, 2 * record.turn + 2)]
        if record.turn > 0:  # the history re-sent: the fake found the previous turn's prompt
            assert record.cached_tokens > 0


def test_fixed_run_uses_completions_and_open_loop() -> None:
    server = FakeServer()
    workload = build_serve_workload(
        WorkloadConfig(name="fixed", num_requests=6, input_len=20, output_len=3)
    )
    config = TrafficConfig(request_rate=200.0, max_concurrency=2, warmup_requests=0)
    result = run_load("http://fake/", workload, config, transport=server.transport())
    assert len(result.records) == 6 and all(r.ok for r in result.records)
    assert all("prompt" in b and "messages" not in b for b in server.requests)
    assert {r.endpoint for r in result.records} == {"completions"}
    assert all(len(r.itl_s) == 2 for r in result.records)
    assert result.duration_s > 0 and result.target == "http://fake/"


def test_errors_are_recorded_and_a_failed_session_stops() -> None:
    workload = build_serve_workload(AGENTIC)
    marker = workload.sessions[1].turns[1].prompt  # session 1 fails on its second turn
    server = FakeServer(fail_when=marker)
    result = run_load(
        "http://fake",
        workload,
        TrafficConfig(concurrency=3, warmup_requests=0),
        transport=server.transport(),
    )
    failed = [r for r in result.records if not r.ok]
    assert len(failed) == 1 and failed[0].status == 400 and "too long" in (failed[0].error or "")
    assert failed[0].session_id == workload.sessions[1].session_id and failed[0].turn == 1
    assert result.skipped_requests == 1 and len(result.records) == 8

    server = FakeServer(raise_when=workload.sessions[0].turns[0].prompt, report_cached=False)
    result = run_load(
        "http://fake",
        workload,
        TrafficConfig(concurrency=1, warmup_requests=0),
        transport=server.transport(),
    )
    failed = [r for r in result.records if not r.ok]
    assert (
        len(failed) == 1
        and "ConnectError" in (failed[0].error or "")
        and result.skipped_requests == 2
    )
    assert all(r.cached_tokens is None for r in result.records if r.ok)


def test_timeouts_are_errors_not_crashes() -> None:
    server = FakeServer(delay_s=0.5)
    workload = build_serve_workload(
        WorkloadConfig(name="fixed", num_requests=2, input_len=5, output_len=5)
    )
    result = run_load(
        "http://fake",
        workload,
        TrafficConfig(concurrency=2, request_timeout_s=0.2, warmup_requests=0),
        transport=server.transport(),
    )
    assert [r.ok for r in result.records] == [False, False]
    assert all("timed out" in (r.error or "") for r in result.records)


def test_model_name_needed_when_models_endpoint_fails() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": {"message": "no"}})

    workload = build_serve_workload(
        WorkloadConfig(name="fixed", num_requests=1, input_len=5, output_len=2)
    )
    with pytest.raises(ValueError, match="model"):
        run_load(
            "http://fake",
            workload,
            TrafficConfig(concurrency=1),
            transport=httpx.MockTransport(handler),
        )
    result = run_load(
        "http://fake",
        workload,
        TrafficConfig(concurrency=1, model="given", warmup_requests=0),
        transport=httpx.MockTransport(handler),
    )
    assert result.model == "given" and result.records[0].status == 404 and not result.records[0].ok
