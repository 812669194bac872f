"""Router pieces without processes: scoring, health, PD decisions, merging, config, retries."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tandem.router.config import (
    HealthPolicy,
    RetryPolicy,
    Timeouts,
    WorkerSpec,
    normalize_url,
    parse_worker_file,
    read_worker_file,
    specs_from_lists,
)
from tandem.router.http.upstream import HopFailure, StreamBroken, Upstream
from tandem.router.pd.merge import (
    ChunkRewriter,
    Identity,
    merged_usage,
    reply_to_chunks,
    rewrite_reply,
)
from tandem.router.pd.split import (
    decide_route,
    decode_body,
    emit_first_token,
    prefill_body,
    prefill_outcome,
)
from tandem.router.placement.prompt_tokens import PromptCounter
from tandem.router.placement.scoring import decode_score, pick_decode, pick_prefill, prefill_score
from tandem.router.workers.registry import HealthState, LoadSnapshot, Worker, WorkerRegistry

POLICY = HealthPolicy()


def _worker(url: str, role: str = "decode", **load: int) -> Worker:
    worker = Worker(WorkerSpec(url, role), POLICY)  # type: ignore[arg-type]
    worker.health.record(True)
    if load:
        worker.on_load(LoadSnapshot.from_json(load), poll_started_at=0.0, reflect_delay_s=0.25)
    return worker


# --- imports ---------------------------------------------------------------------------
def test_router_app_does_not_import_torch() -> None:
    # tandem.kvcache.block_hash (xxhash only) is the one engine module the router may use.
    code = (
        "import sys, tandem.router.http.app, tandem.router.cli; "
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
        "or (m.startswith('tandem.engine') and m not in ('tandem.engine', "
        "'tandem.kvcache.block_hash')) or m.startswith('tandem.server')]; print(heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- scoring ---------------------------------------------------------------------------
def test_prefill_picks_the_worker_with_fewer_queued_tokens_not_fewer_requests() -> None:
    # a: one huge queued prompt; b: many small ones. Tokens decide, not request counts.
    a = _worker("http://a", "prefill", num_waiting_prefill_tokens=8000, num_waiting_requests=1)
    b = _worker("http://b", "prefill", num_waiting_prefill_tokens=600, num_waiting_requests=12)
    assert pick_prefill([a, b], prompt_tokens=500) is b
    assert prefill_score(a, 500) == 8500 and prefill_score(b, 500) == 1100


def test_prefill_counts_tokens_routed_since_the_last_poll() -> None:
    a = _worker("http://a", "prefill", num_waiting_prefill_tokens=100)
    b = _worker("http://b", "prefill", num_waiting_prefill_tokens=300)
    a.dispatch("prefill", 1000, now=10.0)  # sent after the poll: the worker's figure lacks it
    assert pick_prefill([a, b], 200) is b
    # A poll that started well after the dispatch reflects it: the local count goes.
    a.on_load(
        LoadSnapshot.from_json({"num_waiting_prefill_tokens": 100}),
        poll_started_at=11.0,
        reflect_delay_s=0.25,
    )
    assert a.unreflected_tokens() == 0
    assert pick_prefill([a, b], 200) is a


def test_settled_dispatch_stops_counting() -> None:
    a = _worker("http://a", "prefill")
    handle = a.dispatch("prefill", 700, now=1.0)
    assert prefill_score(a, 0) == 700
    a.settle(handle)
    assert prefill_score(a, 0) == 0


def test_decode_score_is_the_kv_fraction_plus_a_sequence_term() -> None:
    # a: bigger cache, more tokens, but a lower fraction in use.
    a = _worker(
        "http://a",
        running_kv_tokens=4000,
        kv_blocks_total=1000,
        block_size=16,
        num_running_requests=4,
    )
    b = _worker(
        "http://b",
        running_kv_tokens=3000,
        kv_blocks_total=250,
        block_size=16,
        num_running_requests=2,
    )
    assert decode_score(a, 0, 0.01) == pytest.approx(4000 / 16000 + 0.04)
    assert decode_score(b, 0, 0.01) == pytest.approx(3000 / 4000 + 0.02)
    assert pick_decode([a, b], 100, 0.01) is a


def test_decode_ties_go_to_the_least_recently_chosen() -> None:
    registry = WorkerRegistry(
        (WorkerSpec("http://a", "decode"), WorkerSpec("http://b", "decode")), POLICY
    )
    for worker in registry.workers:
        worker.health.record(True)
    chosen = []
    for _ in range(4):
        worker = pick_decode(registry.pool(("decode",)), 10, 0.01)
        assert worker is not None
        registry.mark_picked(worker)
        chosen.append(worker.url)
    assert chosen == ["http://a", "http://b", "http://a", "http://b"]


# --- health ----------------------------------------------------------------------------
def test_health_state_machine() -> None:
    state = HealthState(failures_to_down=3, successes_to_up=2)
    assert not state.healthy
    assert state.record(True) and state.healthy  # first probe: up at once
    assert not state.record(False) and not state.record(False)
    assert state.healthy
    assert state.record(False) and not state.healthy  # third failure in a row
    assert not state.record(True) and not state.healthy  # one success is not enough
    assert not state.record(False)
    assert not state.record(True)
    assert state.record(True) and state.healthy  # two in a row
    assert state.consecutive_failures == 0


def test_failures_interrupted_by_a_success_do_not_mark_down() -> None:
    state = HealthState(3, 2)
    state.record(True)
    for ok in (False, False, True, False, False):
        state.record(ok)
    assert state.healthy


# --- when to split, and the hop bodies ---------------------------------------------------
@pytest.mark.parametrize(
    ("body", "kind", "tokens", "pd", "reason"),
    [
        ({"messages": []}, "chat", 1000, True, "long prompt"),
        ({"messages": []}, "chat", 100, False, "short prompt"),
        ({"messages": [], "n": 2}, "chat", 1000, False, "n>1"),
        ({"messages": [], "logprobs": True}, "chat", 1000, False, "logprobs"),
        ({"messages": [], "max_tokens": 1}, "chat", 1000, False, "max_tokens=1"),
        ({"prompt": "x", "logprobs": 0}, "completion", 1000, False, "logprobs"),
        ({"prompt": "x", "echo": True}, "completion", 1000, False, "echo"),
        ({"prompt": ["x", "y"]}, "completion", 1000, False, "several prompts"),
        ({"prompt": [1, 2, 3]}, "completion", 1000, True, "long prompt"),
    ],
)
def test_decide_route(body: dict, kind: str, tokens: int, pd: bool, reason: str) -> None:
    decision = decide_route(body, kind, tokens, 256, have_prefill=True)  # type: ignore[arg-type]
    assert (decision.pd, decision.reason) == (pd, reason)


def test_no_prefill_pool_means_whole_requests() -> None:
    assert decide_route({"messages": []}, "chat", 5000, 256, have_prefill=False).pd is False


def test_prefill_body() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_completion_tokens": 50,
        "stream_options": {"include_usage": True},
        "min_tokens": 5,
        "temperature": 0,
    }
    out = prefill_body(body, "http://decode:1")
    assert out["stream"] is False and out["max_tokens"] == 1 and out["min_tokens"] == 1
    assert "max_completion_tokens" not in out and "stream_options" not in out
    assert out["kv_transfer_params"] == {
        "do_remote_decode": True,
        "remote_decode": "http://decode:1",
    }
    assert (
        body["stream"] is True and body["max_completion_tokens"] == 50
    )  # the original is untouched


def test_decode_body_keeps_the_client_request_and_adds_the_handle() -> None:
    body = {"messages": [], "stream": True, "max_tokens": 20}
    out = decode_body(body, {"first_token_ids": [5], "transfer_id": "t"}, emit_first_token=False)
    assert out["max_tokens"] == 20 and out["stream"] is True
    assert out["stream_options"] == {"include_usage": True}  # the router always counts usage
    assert out["kv_transfer_params"] == {
        "first_token_ids": [5],
        "transfer_id": "t",
        "do_remote_prefill": True,
        "emit_first_token": False,
    }
    assert "kv_transfer_params" not in decode_body(body, None, True)


def test_emit_first_token_only_where_the_router_cannot_send_it_early() -> None:
    tool = {"type": "function", "function": {"name": "f"}}
    assert emit_first_token({"stream": False}) is True
    assert emit_first_token({"stream": True}) is False
    assert emit_first_token({"stream": True, "tools": [tool]}) is True
    assert emit_first_token({"stream": True, "tools": [tool], "tool_choice": "none"}) is False
    # Half a multi-byte character: the decode worker sends it whole with the next token.
    assert emit_first_token({"stream": True}, "caf\ufffd") is True
    assert emit_first_token({"stream": True}, "café") is False


def _prefill_reply(reason: str = "length", kv: object = "missing") -> dict:
    reply = {
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": reason}
        ],
        "usage": {
            "prompt_tokens": 300,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 256},
        },
    }
    if kv != "missing":
        reply["kv_transfer_params"] = kv
    return reply


def test_prefill_outcome() -> None:
    handle = {"first_token_ids": [9], "transfer_id": "t"}
    body = {"messages": [], "max_tokens": 20}
    going = prefill_outcome(_prefill_reply("length", handle), body, "chat")
    assert (
        going.takes_part and not going.complete and going.kv == handle and going.first_text == "Hi"
    )
    assert prefill_outcome(_prefill_reply("stop", None), body, "chat").complete  # EOS at once
    assert prefill_outcome(
        _prefill_reply("length", None), body, "chat"
    ).complete  # nothing to hand over
    assert prefill_outcome(_prefill_reply("length", handle), {"max_tokens": 1}, "chat").complete
    legacy = prefill_outcome(_prefill_reply("length"), body, "chat")
    assert not legacy.takes_part and not legacy.complete


# --- merging ---------------------------------------------------------------------------
IDENT = Identity("chatcmpl-router", 1234, "smollm2-135m", "chat")

# A decode worker's stream as recorded (emit_first_token false: it starts after the first token).
DECODE_CHUNKS = [
    {
        "id": "chatcmpl-w",
        "object": "chat.completion.chunk",
        "created": 99,
        "model": "smollm2-135m",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "usage": None,
    },
    {
        "id": "chatcmpl-w",
        "object": "chat.completion.chunk",
        "created": 99,
        "model": "smollm2-135m",
        "choices": [
            {"index": 0, "delta": {"content": " world"}, "logprobs": None, "finish_reason": None}
        ],
        "usage": None,
    },
    {
        "id": "chatcmpl-w",
        "object": "chat.completion.chunk",
        "created": 99,
        "model": "smollm2-135m",
        "choices": [
            {"index": 0, "delta": {"content": "!"}, "logprobs": None, "finish_reason": "stop"}
        ],
        "usage": None,
    },
    {
        "id": "chatcmpl-w",
        "object": "chat.completion.chunk",
        "created": 99,
        "model": "smollm2-135m",
        "choices": [],
        "usage": {
            "prompt_tokens": 300,
            "completion_tokens": 3,
            "total_tokens": 303,
            "prompt_tokens_details": {"cached_tokens": 300},
        },
    },
]
PREFILL_USAGE = {
    "prompt_tokens": 300,
    "completion_tokens": 1,
    "total_tokens": 301,
    "prompt_tokens_details": {"cached_tokens": 256},
}


def test_stream_merge_with_usage() -> None:
    rewrite = ChunkRewriter(IDENT, include_usage=True, drop_role=True, prefill_usage=PREFILL_USAGE)
    out = [c for c in (rewrite(dict(chunk)) for chunk in DECODE_CHUNKS) if c is not None]
    assert len(out) == 3  # the worker's role chunk is gone: the router sent its own
    assert {(c["id"], c["created"]) for c in out} == {("chatcmpl-router", 1234)}
    assert [c["choices"][0]["delta"].get("content") for c in out[:2]] == [" world", "!"]
    assert out[1]["choices"][0]["finish_reason"] == "stop" and rewrite.finish_reason == "stop"
    usage = out[2]["usage"]
    # Prompt and cached from the prefill hop (the decode worker's cache hits are the blocks
    # it was just sent), completion from the decode hop, which counts the first token.
    assert usage == {
        "prompt_tokens": 300,
        "completion_tokens": 3,
        "total_tokens": 303,
        "prompt_tokens_details": {"cached_tokens": 256},
    }
    assert all("usage" in c for c in out)


def test_stream_merge_without_usage_strips_it() -> None:
    rewrite = ChunkRewriter(IDENT, include_usage=False, drop_role=False)
    out = [c for c in (rewrite(dict(chunk)) for chunk in DECODE_CHUNKS) if c is not None]
    assert len(out) == 3 and out[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("usage" not in c for c in out)
    assert rewrite.usage is not None and rewrite.usage["completion_tokens"] == 3  # still counted


def test_merged_usage_counts_cached_tokens_once() -> None:
    decode = {
        "prompt_tokens": 300,
        "completion_tokens": 10,
        "total_tokens": 310,
        "prompt_tokens_details": {"cached_tokens": 300},
    }
    merged = merged_usage(PREFILL_USAGE, decode)
    assert merged["prompt_tokens_details"]["cached_tokens"] == 256
    assert merged["total_tokens"] == 310 and merged["completion_tokens"] == 10
    assert merged_usage(None, decode) == decode


def test_whole_reply_rewrite() -> None:
    reply = {
        "id": "chatcmpl-w",
        "object": "chat.completion",
        "created": 5,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi world!"},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 300,
            "completion_tokens": 3,
            "total_tokens": 303,
            "prompt_tokens_details": {"cached_tokens": 300},
        },
        "kv_transfer_params": {"adopted_blocks": 18},
    }
    out = rewrite_reply(reply, IDENT, PREFILL_USAGE)
    assert (
        out["id"] == "chatcmpl-router" and out["created"] == 1234 and out["model"] == "smollm2-135m"
    )
    assert "kv_transfer_params" not in out
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
    assert reply["id"] == "chatcmpl-w"  # not mutated


def test_reply_to_chunks_keeps_tool_calls() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'},
    }
    reply = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
    }
    chunks = reply_to_chunks(reply, IDENT, include_usage=True)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pieces = chunks[1]["choices"][0]["delta"]["tool_calls"]
    assert pieces == [
        {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'},
        }
    ]
    assert chunks[2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 1
    assert {c["id"] for c in chunks} == {"chatcmpl-router"}


def test_reply_to_chunks_for_completions() -> None:
    ident = Identity("cmpl-router", 1, "m", "completion")
    reply = {
        "choices": [{"index": 0, "text": " Paris", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3},
    }
    chunks = reply_to_chunks(reply, ident, include_usage=False)
    assert len(chunks) == 1 and chunks[0]["choices"][0]["text"] == " Paris"
    assert chunks[0]["object"] == "text_completion" and "usage" not in chunks[0]


# --- config ----------------------------------------------------------------------------
def test_worker_file_json_and_yaml(tmp_path: Path) -> None:
    data = {
        "prefill": ["127.0.0.1:9001"],
        "decode": ["http://127.0.0.1:9002/v1/"],
        "worker": [{"url": "http://h:9003"}],
    }
    expected = (
        WorkerSpec("http://127.0.0.1:9001", "prefill"),
        WorkerSpec("http://127.0.0.1:9002", "decode"),
        WorkerSpec("http://h:9003", "both"),
    )
    path = tmp_path / "workers.json"
    path.write_text(json.dumps(data))
    assert read_worker_file(path) == expected
    yaml_text = (
        "prefill:\n  - 127.0.0.1:9001\ndecode: [http://127.0.0.1:9002/v1/]\n"
        "worker:\n  - url: http://h:9003\n"
    )
    assert parse_worker_file(yaml_text, ".yaml") == expected
    assert parse_worker_file("", ".json") == ()


def test_worker_file_errors() -> None:
    with pytest.raises(ValueError, match="unknown key 'decoder'"):
        parse_worker_file('{"decoder": ["http://a"]}')
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_worker_file("{prefill: ")
    with pytest.raises(ValueError, match="mapping"):
        parse_worker_file('["http://a"]')


def test_urls_are_normalized_and_deduplicated() -> None:
    assert normalize_url("localhost:8001/") == "http://localhost:8001"
    assert specs_from_lists(["a:1", "http://a:1/v1"], [], []) == (
        WorkerSpec("http://a:1", "prefill"),
    )


def test_reload_keeps_the_state_of_workers_that_stay() -> None:
    a, b, c = (
        WorkerSpec("http://a", "decode"),
        WorkerSpec("http://b", "decode"),
        WorkerSpec("http://c", "prefill"),
    )
    registry = WorkerRegistry((a, b), POLICY)
    kept = registry.workers[0]
    kept.health.record(True)
    kept.in_flight = 2
    added, removed = registry.replace((a, c))
    assert [w.spec for w in added] == [c] and [w.spec for w in removed] == [b]
    assert registry.workers[0] is kept and kept.healthy and kept.in_flight == 2
    assert [w.spec for w in registry.pool(("prefill",), healthy_only=False)] == [c]


# --- prompt tokens ---------------------------------------------------------------------
def test_prompt_count_estimate_and_tokenizer(tmp_path: Path) -> None:
    body = {"messages": [{"role": "user", "content": "x" * 400}]}
    assert asyncio.run(PromptCounter().count(body, "chat")) == 100
    assert asyncio.run(PromptCounter().count({"prompt": [1, 2, 3]}, "completion")) == 3
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    counter = PromptCounter(tmp_path)
    assert counter.exact
    assert asyncio.run(counter.count({"prompt": "hello world hello"}, "completion")) == 3


# --- retries before the first byte -------------------------------------------------------
def _upstream(handler, retry: RetryPolicy | None = None) -> tuple[Upstream, list[str]]:  # noqa: ANN001
    failures: list[str] = []
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    upstream = Upstream(
        client,
        Timeouts(connect_s=1, first_byte_s=0.5, idle_s=0.5),
        retry or RetryPolicy(max_attempts=3, backoff_s=0.001),
        lambda hop, failure: failures.append(f"{failure.worker.url}:{failure.status}"),
        lambda hop: None,
    )
    return upstream, failures


def _picker(workers: list[Worker]):  # noqa: ANN202
    def pick(exclude: set[str]) -> Worker | None:
        return next((w for w in workers if w.url not in exclude), None)

    return pick


def test_retry_moves_to_another_worker_before_the_first_byte() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            raise httpx.ConnectError("refused", request=request)
        if request.url.host == "b":
            return httpx.Response(503, json={"error": {"message": "full"}})
        return httpx.Response(200, json={"ok": True})

    workers = [_worker("http://a"), _worker("http://b"), _worker("http://c")]
    upstream, failures = _upstream(handler)

    async def run() -> tuple[str, int, bytes]:
        hop = await upstream.open_with_retries(
            "direct", _picker(workers), "/v1/chat/completions", {}, {}, "prefill", 10
        )
        data = await upstream.read(hop.response)
        await hop.close()
        return hop.worker.url, hop.attempts, data

    url, attempts, data = asyncio.run(run())
    assert url == "http://c" and attempts == 3 and json.loads(data) == {"ok": True}
    assert failures == ["http://a:None", "http://b:503"]
    assert all(w.in_flight == 0 and w.unreflected_tokens() == 0 for w in workers)


def test_the_load_a_hop_adds_can_depend_on_the_worker() -> None:
    """kv_aware counts a just-sent request by the tokens that worker must compute (its cached
    prefix excluded), so each retry dispatches that worker's own figure."""
    workers = [_worker("http://a"), _worker("http://b")]
    predicted = {"http://a": 300, "http://b": 2500}
    seen: dict[str, int] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        url = f"http://{request.url.host}"
        seen[url] = next(w for w in workers if w.url == url).unreflected_tokens("prefill")
        if url == "http://a":
            return httpx.Response(503, json={"error": {"message": "full"}})
        return httpx.Response(200, json={"ok": True})

    upstream, _ = _upstream(handler)

    async def run() -> None:
        hop = await upstream.open_with_retries(
            "direct", _picker(workers), "/x", {}, {}, "prefill", lambda w: predicted[w.url]
        )
        await hop.close()

    asyncio.run(run())
    assert seen == predicted


def test_client_errors_are_not_retried() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.host)
        return httpx.Response(400, json={"error": {"message": "bad"}})

    upstream, _ = _upstream(handler)

    async def run() -> int:
        hop = await upstream.open_with_retries(
            "direct",
            _picker([_worker("http://a"), _worker("http://b")]),
            "/v1/completions",
            {},
            {},
            "prefill",
            1,
        )
        await hop.close()
        return hop.status

    assert asyncio.run(run()) == 400 and calls == ["a"]


def test_all_attempts_failing_raises_the_last_failure() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"error": {"message": "boom"}})

    upstream, failures = _upstream(handler, RetryPolicy(max_attempts=2, backoff_s=0.001))
    only = _worker("http://a")

    async def run() -> None:
        await upstream.open_with_retries("direct", _picker([only]), "/x", {}, {}, "prefill", 1)

    with pytest.raises(HopFailure) as info:
        asyncio.run(run())
    # One worker that answered 5xx may be tried again: it was alive.
    assert info.value.status == 500 and failures == ["http://a:500", "http://a:500"]
    assert only.in_flight == 0


def test_no_worker_at_all_is_a_lookup_error() -> None:
    upstream, _ = _upstream(lambda request: httpx.Response(200))
    with pytest.raises(LookupError):
        asyncio.run(
            upstream.open_with_retries("decode", lambda exclude: None, "/x", {}, {}, "decode", 1)
        )


def test_sse_events_and_broken_streams() -> None:
    good = b'data: {"a":1}\n\n: keep-alive\n\ndata: [DONE]\n\n'
    cut = b'data: {"a":1}\n\n'

    async def events(payload: bytes) -> list[str]:
        upstream, _ = _upstream(lambda request: httpx.Response(200, content=payload))
        response = await upstream.client.send(
            upstream.client.build_request("GET", "http://a/"), stream=True
        )
        return [e async for e in upstream.events(response)]

    assert asyncio.run(events(good)) == ['{"a":1}', "[DONE]"]
    with pytest.raises(StreamBroken, match="before \\[DONE\\]"):
        asyncio.run(events(cut))
