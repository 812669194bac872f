"""The router against fake workers on real ports: the protocol, merging, and every failure a
real worker will not produce on demand (500s, hangs, streams cut in the middle, 400s)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tandem.router.config import BreakerPolicy, HealthPolicy, Timeouts, WorkerSpec
from tests.support.live_server import TEST_SECRET
from tests.support.router_helpers import (
    PROMPT_TOKENS,
    FakeWorker,
    metric,
    read_stream,
    stream_text,
    wait_for,
)

FakeFactory = Callable[[str], tuple[FakeWorker, str]]
ADMIN = {"Authorization": f"Bearer {TEST_SECRET}"}  # the router fixture's cluster secret opens its control plane
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5}
COMPLETION = {"model": "fake", "prompt": "Say hello.", "max_tokens": 5}
FULL = "Hello there, friend."
# A worker that breaks its streams on purpose but is otherwise fine: neither its health nor
# its breaker may take it out while a test counts on it.
TOLERANT = {
    "health": HealthPolicy(interval_s=0.1, timeout_s=1.0, failures_to_down=50),
    "breaker": BreakerPolicy(failures=50),
}


def _pd_router(
    fake_workers: FakeFactory, start_router: Callable[..., str], **fields: object
) -> tuple[FakeWorker, FakeWorker, str]:
    prefill, prefill_url = fake_workers("prefill")
    decode, decode_url = fake_workers("decode")
    url = start_router(
        [WorkerSpec(prefill_url, "prefill"), WorkerSpec(decode_url, "decode")], **fields
    )
    return prefill, decode, url


def _ids(events: list) -> set[tuple[str, int]]:
    return {(e["id"], e["created"]) for e in events if isinstance(e, dict)}


# --- the protocol and the merge ------------------------------------------------------------
def test_pd_stream_sends_the_first_token_itself_and_merges(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    prefill, decode, url = _pd_router(fake_workers, start_router)
    events = read_stream(url, {**CHAT, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert stream_text(events) == FULL  # every token once, in order
    assert len(_ids(events)) == 1 and next(iter(_ids(events)))[0].startswith("chatcmpl-")
    assert sum("role" in (c["choices"] or [{}])[0].get("delta", {}) for c in chunks) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["prompt_tokens_details"]["cached_tokens"] == 32  # the prefill worker's, once
    assert usage["completion_tokens"] == 5 and usage["total_tokens"] == 55
    # The hops: a one-token prefill naming the decode worker, then the client's request.
    hop1, hop2 = prefill.requests[-1], decode.requests[-1]
    assert hop1["max_tokens"] == 1 and hop1["stream"] is False
    assert hop1["kv_transfer_params"]["remote_decode"] == url_of(decode, url)
    assert hop2["max_tokens"] == 5 and hop2["stream"] is True
    assert hop2["kv_transfer_params"]["emit_first_token"] is False
    assert hop2["kv_transfer_params"]["first_token_ids"] == [7]


def url_of(worker: FakeWorker, router_url: str) -> str:
    workers = httpx.get(f"{router_url}/workers").json()["workers"]
    return next(w["url"] for w in workers if w["role"] == worker.name)


def test_pd_whole_and_completions(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    _, decode, url = _pd_router(fake_workers, start_router)
    reply = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30).json()
    assert reply["choices"][0]["message"]["content"] == FULL
    assert reply["id"].startswith("chatcmpl-") and reply["id"] != "decode-reply"
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert "kv_transfer_params" not in reply
    assert decode.requests[-1]["kv_transfer_params"]["emit_first_token"] is True
    reply = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=30).json()
    assert reply["choices"][0]["text"] == FULL and reply["id"].startswith("cmpl-")
    events = read_stream(url, COMPLETION, "/v1/completions")
    assert stream_text(events) == FULL and len(_ids(events)) == 1
    assert all("usage" not in e for e in events if isinstance(e, dict))  # not asked for


def test_tools_stream_lets_the_decode_worker_emit_everything(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    _, decode, url = _pd_router(fake_workers, start_router)
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object"}},
    }
    events = read_stream(url, {**CHAT, "tools": [tool]})
    assert stream_text(events) == FULL
    assert decode.requests[-1]["kv_transfer_params"]["emit_first_token"] is True


def test_answer_complete_at_prefill_is_streamed_by_the_router(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    prefill, decode, url = _pd_router(fake_workers, start_router)
    prefill.behaviour.tokens = ("Hi",)  # stops at the first token: nothing to hand over
    events = read_stream(url, {**CHAT, "stream_options": {"include_usage": True}})
    assert stream_text(events) == "Hi" and events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 1
    assert decode.requests == []


def test_short_prompts_and_n_skip_the_prefill_hop(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    prefill, decode, url = _pd_router(fake_workers, start_router, pd_min_prompt_tokens=100)
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    long = {**CHAT, "messages": [{"role": "user", "content": "word " * 500}]}
    assert (
        httpx.post(f"{url}/v1/chat/completions", json={**long, "n": 2}, timeout=30).status_code
        == 200
    )
    assert prefill.requests == [] and len(decode.requests) == 2
    assert "kv_transfer_params" not in decode.requests[0]
    assert httpx.post(f"{url}/v1/chat/completions", json=long, timeout=30).status_code == 200
    assert len(prefill.requests) == 1


def test_prefill_worker_outside_the_protocol(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    """A prefill reply without kv_transfer_params: the decode hop runs the whole request."""
    prefill, decode, url = _pd_router(fake_workers, start_router)
    prefill.behaviour.pd = False
    events = read_stream(url, {**CHAT, "stream_options": {"include_usage": True}})
    assert stream_text(events) == FULL
    assert "kv_transfer_params" not in decode.requests[-1]
    assert (
        events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    )  # the decode worker's own


# --- failures --------------------------------------------------------------------------------
def test_500_and_refused_connections_are_retried_on_another_worker(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    bad, bad_url = fake_workers("bad")
    good, good_url = fake_workers("good")
    bad.behaviour.mode = "error500"
    url = start_router(
        [
            WorkerSpec(bad_url, "both"),
            WorkerSpec(good_url, "both"),
            WorkerSpec("http://127.0.0.1:9", "both"),
        ]
    )
    for _ in range(4):
        reply = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == FULL
        assert stream_text(read_stream(url, CHAT)) == FULL
    metrics = httpx.get(f"{url}/metrics").text
    bad_500s = metric(metrics, "tandem_router_worker_requests_total", worker=bad_url, outcome="500")
    refused = metric(metrics, "tandem_router_worker_requests_total", outcome="error")
    # bad was tried, and every failed attempt was retried: the requests succeeded elsewhere.
    assert bad_500s == len(bad.requests) > 0
    assert metric(metrics, "tandem_router_retries_total") == bad_500s + refused


def test_all_workers_failing_passes_the_last_5xx_through(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    bad, bad_url = fake_workers("bad")
    bad.behaviour.mode = "error500"
    url = start_router([WorkerSpec(bad_url, "decode")])
    reply = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
    assert reply.status_code == 500 and reply.json()["error"]["message"] == "bad broke"
    assert len(bad.requests) == 3  # max_attempts


def test_hung_worker_times_out_and_the_request_moves(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    hung, hung_url = fake_workers("hung")
    good, good_url = fake_workers("good")
    hung.behaviour.mode = "hang"
    hung.behaviour.waiting_prefill_tokens = 0
    good.behaviour.running_kv_tokens = 10  # the hung one looks idler: it is tried first
    hung.behaviour.hang_s = 60.0
    url = start_router([WorkerSpec(hung_url, "decode"), WorkerSpec(good_url, "decode")],
                       timeouts=Timeouts(connect_s=5.0, first_byte_s=3.0, idle_s=10.0))
    time.sleep(0.3)  # a poll has seen both loads
    started = time.monotonic()
    reply = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=90)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == FULL
    # The first-byte limit (3 s) cut the hung hop, long before its 60 s were up.
    assert len(hung.requests) == 1 and 3.0 <= time.monotonic() - started < 30.0


def test_stream_cut_in_the_middle_ends_with_an_error_event_without_migration(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    worker, worker_url = fake_workers("dropper")
    worker.behaviour.mode = "drop"
    url = start_router([WorkerSpec(worker_url, "both")], migration_limit=0)
    events = read_stream(url, CHAT)
    assert stream_text(events) == "Hello there"
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "worker_stream_broken"
    assert "return_token_ids" not in worker.requests[-1]  # nothing to follow


def test_a_broken_stream_continues_on_a_worker_with_the_tokens_sent_so_far(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    """The fake drops every stream at its third chunk: the router moves the stream twice,
    each time sending the token ids the client has; the client sees every token once."""
    worker, worker_url = fake_workers("dropper")
    worker.behaviour.mode = "drop"
    url = start_router([WorkerSpec(worker_url, "both")], **TOLERANT)
    for body, path in ((CHAT, "/v1/chat/completions"), (COMPLETION, "/v1/completions")):
        events = read_stream(url, {**body, "stream_options": {"include_usage": True}}, path)
        assert stream_text(events) == FULL
        assert events[-1] == "[DONE]" and not any(
            isinstance(e, dict) and "error" in e for e in events
        )
        assert len(_ids(events)) == 1
        chunks = [e for e in events if isinstance(e, dict)]
        assert all("token_ids" not in c for chunk in chunks for c in chunk["choices"])
        if path == "/v1/chat/completions":
            assert sum("role" in (c["choices"] or [{}])[0].get("delta", {}) for c in chunks) == 1
        assert chunks[-1]["usage"]["completion_tokens"] == 5
        first, second, third = worker.requests[-3:]
        assert first["return_token_ids"] is True and "kv_transfer_params" not in first
        assert second["kv_transfer_params"] == {
            "do_remote_prefill": True, "first_token_ids": [7, 8], "emit_first_token": False,
            "streamed_from": 0,
        }
        assert third["kv_transfer_params"]["first_token_ids"] == [7, 8, 9, 10]
        assert third["max_tokens"] == 5  # the worker counts the tokens it is given
    text = httpx.get(f"{url}/metrics").text
    assert metric(text, "tandem_router_migrations_total", route="direct") == 4


def test_migration_limit_and_streams_that_cannot_move(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    worker, worker_url = fake_workers("dropper")
    worker.behaviour.mode = "drop"
    url = start_router([WorkerSpec(worker_url, "both")], migration_limit=1, **TOLERANT)
    events = read_stream(url, CHAT)
    assert stream_text(events) == "Hello there, friend"
    assert events[-2]["error"]["code"] == "worker_stream_broken"
    events = read_stream(url, {**CHAT, "n": 2})  # two sequences: not followed
    assert events[-2]["error"]["code"] == "worker_stream_broken"
    assert "return_token_ids" not in worker.requests[-1]


def test_a_pd_stream_whose_decode_worker_breaks_moves_after_the_first_token(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    """The router showed the prefill's first token itself (streamed_from 1); the decode
    worker's stream broke after two more; the next worker gets all three."""
    prefill, decode, url = _pd_router(fake_workers, start_router, **TOLERANT)
    decode.behaviour.mode = "drop"
    events = read_stream(url, {**CHAT, "return_token_ids": True})
    assert stream_text(events) == FULL
    kv = decode.requests[-1]["kv_transfer_params"]
    assert kv == {"do_remote_prefill": True, "first_token_ids": [7, 8, 9],
                  "emit_first_token": False, "streamed_from": 1}
    assert "transfer_id" not in kv  # the prefill's lease may be gone: computed again
    # The client asked for token ids: the workers' pass through.
    ids = [i for e in events if isinstance(e, dict) for c in e["choices"]
           for i in c.get("token_ids", [])]
    assert ids == [8, 9, 10, 11]  # the first token came from the prefill reply, as text
    # The decode half moved: the prefill worker's held KV is released at once.
    assert wait_for(lambda: prefill.releases == ["prefill-t1"])
    decode.behaviour.mode = "ok"
    assert stream_text(read_stream(url, CHAT)) == FULL
    time.sleep(0.2)
    assert prefill.releases == ["prefill-t1"]  # a clean PD stream leaves it to the decode worker


def test_a_stream_queued_on_its_worker_longer_than_the_idle_timeout_is_not_broken(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    """A busy worker sends a chat stream's role chunk at once and its first token after the
    request's wait in its queue: the first-byte timeout bounds that wait, the idle timeout
    only the gaps after the first token."""

    worker, worker_url = fake_workers("busy")
    worker.behaviour.queue_s = 1.5
    url = start_router([WorkerSpec(worker_url, "both")],
                       timeouts=Timeouts(connect_s=1.0, first_byte_s=5.0, idle_s=0.5))
    assert stream_text(read_stream(url, CHAT)) == FULL


def test_client_errors_pass_through_unchanged(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    prefill, decode, url = _pd_router(fake_workers, start_router)
    prefill.behaviour.mode = "bad_request"
    for stream in (False, True):
        reply = httpx.post(
            f"{url}/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30
        )
        assert reply.status_code == 400
        assert reply.json()["error"] == {
            "message": "bad temperature",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_value",
        }
    assert len(prefill.requests) == 2 and decode.requests == []  # no retry, no fallback
    bad = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


def test_failed_prefill_hop_falls_back_to_the_decode_worker(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    prefill, decode, url = _pd_router(fake_workers, start_router)
    prefill.behaviour.mode = "error500"
    events = read_stream(url, CHAT)
    assert stream_text(events) == FULL
    assert "kv_transfer_params" not in decode.requests[-1]
    assert "tandem_router_pd_fallbacks_total 1.0" in httpx.get(f"{url}/metrics").text


def test_no_pool_is_a_503_in_openai_shape(start_router: Callable[..., str]) -> None:
    url = start_router([WorkerSpec("http://127.0.0.1:9", "decode")])
    assert httpx.get(f"{url}/health").status_code == 503
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        reply = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert reply.status_code == 503
        assert reply.json()["error"]["code"] == "no_healthy_worker"
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_health_goes_down_after_three_failures_and_up_after_two(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    worker, worker_url = fake_workers("flaky")
    url = start_router([WorkerSpec(worker_url, "both")])

    def state() -> dict:
        return httpx.get(f"{url}/workers").json()["workers"][0]

    assert state()["healthy"] and httpx.get(f"{url}/health").status_code == 200
    worker.behaviour.health_status = 503
    assert wait_for(lambda: not state()["healthy"], timeout=5)
    assert state()["consecutive_failures"] >= 3
    assert httpx.get(f"{url}/health").status_code == 503
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 503
    worker.behaviour.health_status = 200
    assert wait_for(lambda: state()["healthy"], timeout=5)
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_client_disconnect_closes_the_upstream_stream(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    worker, worker_url = fake_workers("slow")
    worker.behaviour.tokens = tuple(f" t{i}" for i in range(2000))
    url = start_router([WorkerSpec(worker_url, "both")])
    body = {**CHAT, "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    assert wait_for(lambda: worker.disconnects == 1, timeout=5)
    assert wait_for(
        lambda: httpx.get(f"{url}/workers").json()["workers"][0]["in_flight"] == 0, timeout=5
    )


# --- the worker list ---------------------------------------------------------------------
def test_reload_from_the_config_file(
    tmp_path: Path, fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    first, first_url = fake_workers("first")
    second, second_url = fake_workers("second")
    config = tmp_path / "workers.yaml"
    config.write_text(f"worker:\n  - {first_url}\n")
    url = start_router(config_file=config)
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    config.write_text(f"decode: [{second_url}]\n")
    assert httpx.post(f"{url}/workers/reload", timeout=30).status_code == 401  # operators only
    change = httpx.post(f"{url}/workers/reload", timeout=30, headers=ADMIN).json()
    assert change["added"] == [second_url] and change["removed"] == [first_url]
    assert [(w["url"], w["role"], w["healthy"]) for w in change["workers"]] == [
        (second_url, "decode", True)
    ]
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    assert len(first.requests) == 1 and len(second.requests) == 1
    config.write_text("decoder: []\n")
    reply = httpx.post(f"{url}/workers/reload", timeout=30, headers=ADMIN)
    assert reply.status_code == 400 and "decoder" in reply.json()["error"]["message"]
    # A bad file changes nothing: never a partial view.
    workers = httpx.get(f"{url}/workers", timeout=10).json()["workers"]
    assert [w["url"] for w in workers] == [second_url]
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_health_reports_each_pool(
    fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    prefill, decode, url = _pd_router(fake_workers, start_router)
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["status"] == "ok"
    assert health["pools"]["prefill"] == {"total": 1, "up": 1, "available": 1}
    assert health["pools"]["decode"] == {"total": 1, "up": 1, "available": 1}
    prefill.behaviour.health_status = 503
    assert wait_for(lambda: httpx.get(f"{url}/health").json()["status"] == "degraded")
    assert httpx.get(f"{url}/health").status_code == 200  # served whole on the decode worker
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    decode.behaviour.health_status = 503
    assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 503)
    assert httpx.get(f"{url}/health").json()["pools"]["decode"]["up"] == 0


def test_models_and_metrics(fake_workers: FakeFactory, start_router: Callable[..., str]) -> None:
    prefill, decode, url = _pd_router(fake_workers, start_router)
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "fake"
    read_stream(url, {**CHAT, "stream_options": {"include_usage": True}})
    text = httpx.get(f"{url}/metrics").text
    prefill_url, decode_url = url_of(prefill, url), url_of(decode, url)
    # One streamed PD request, counted once everywhere (GET /v1/models is not a request).
    requests = metric(text, "tandem_router_requests_total")
    assert requests == 1 == metric(
        text, "tandem_router_requests_total", route="pd", endpoint="chat", status="200"
    )
    assert metric(text, "tandem_router_time_to_first_token_seconds_count", route="pd") == 1
    assert metric(text, "tandem_router_pd_prefill_hop_seconds_count") == 1
    assert metric(text, "tandem_router_overhead_seconds_count") == 1
    assert metric(text, "tandem_router_pd_decode_first_output_seconds_count") == 1
    for worker, role in ((prefill_url, "prefill"), (decode_url, "decode")):
        assert metric(text, "tandem_router_worker_healthy", worker=worker, role=role) == 1
    # Prompt tokens on the worker that read the prompt, generated ones on the decode worker.
    assert metric(text, "tandem_router_prompt_tokens_total", worker=prefill_url) == PROMPT_TOKENS
    assert metric(text, "tandem_router_generation_tokens_total", worker=decode_url) == 5


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_authorization_is_passed_to_workers(
    path: str, fake_workers: FakeFactory, start_router: Callable[..., str]
) -> None:
    prefill, decode, url = _pd_router(fake_workers, start_router)
    body = CHAT if "chat" in path else COMPLETION
    reply = httpx.post(
        f"{url}{path}", json=body, headers={"Authorization": "Bearer sk-x"}, timeout=30
    )
    assert reply.status_code == 200
    assert prefill.authorization == ["Bearer sk-x"] and decode.authorization == ["Bearer sk-x"]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/messages", {"model": "fake", "max_tokens": 5,
                      "messages": [{"role": "user", "content": "Say hello."}]}),
    ("/v1/responses", {"model": "fake", "max_output_tokens": 5, "input": "Say hello.", "store": False}),
])
def test_a_broken_messages_or_responses_stream_moves_with_no_gap_or_repeat(
    fake_workers: FakeFactory, start_router: Callable[..., str], path: str, body: dict
) -> None:
    """The adapters translate the relay's output, so a stream moved between workers mid-way
    (twice here: the fake drops every stream at its third chunk) reaches the client as one
    well-formed stream in its own protocol: every text delta once, in order, no error event."""
    from tests.support.protocol_streams import check_anthropic_stream, check_responses_stream
    from tests.support.recording_proxy import parse_sse

    worker, worker_url = fake_workers("dropper")
    worker.behaviour.mode = "drop"
    url = start_router([WorkerSpec(worker_url, "both")], **TOLERANT)
    response = httpx.post(f"{url}{path}", json={**body, "stream": True}, timeout=60.0)
    assert response.status_code == 200, response.text
    frames = parse_sse(response.content)
    if path == "/v1/messages":
        message = check_anthropic_stream(frames)
        deltas = [f.json()["delta"]["text"] for f in frames if f.event == "content_block_delta"]
        assert "".join(deltas) == FULL and [b["text"] for b in message.blocks] == [FULL]
        assert message.usage["output_tokens"] == 5
    else:
        result = check_responses_stream(frames)
        deltas = [f.json()["delta"] for f in frames if f.event == "response.output_text.delta"]
        assert "".join(deltas) == FULL
        assert result.response["output"][0]["content"][0]["text"] == FULL
        assert result.usage["output_tokens"] == 5
    assert worker.requests[-1]["kv_transfer_params"]["first_token_ids"] == [7, 8, 9, 10]  # moved twice
    text = httpx.get(f"{url}/metrics").text
    assert metric(text, "tandem_router_migrations_total", route="direct") >= 2
