"""Hostile clients, generated: random JSON bodies and header sets against a worker and a router.

Hypothesis builds each request from the endpoints both serve, bodies that are a valid request
with fields replaced, added or forged (internal fields, huge numbers, non-finite floats, lone
surrogates, wrong types, deep nesting) or random JSON outright, and headers with garbage
credentials and peer signatures. Whatever comes: no 5xx, no dead engine, and once it is over
both still serve an ordinary request with no KV block held. Bounded (a fixed number of cases,
derandomized) so it is the same run on every box; the worker has a 64-token context, so no
case can generate for long.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.live_server import (
    TEST_SECRET,
    LiveServer,
    start_router,
    start_server,
    stop_server,
)

MODEL = "smollm2-135m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "temperature": 0}
PATHS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/models", "/health",
         "/load", "/metrics", "/kv/release", "/kv/events", "/kv/snapshot", "/reset_prefix_cache",
         "/workers/reload", "/workers/127.0.0.1:1/drain", "/v1/usage", "/v1/nothing"]


@dataclass
class Targets:
    worker: LiveServer
    router: str


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Targets]:
    logs = tmp_path_factory.mktemp("hostile")
    worker = start_server(logs / "worker.log", "--kv-cache-memory", "64MiB", "--max-model-len", "64",
                          "--max-num-seqs", "8", secret=TEST_SECRET)
    router = None
    try:
        url, router = start_router(logs / "router.log", "--worker", worker.url, "--no-ledger",
                                   "--first-byte-timeout", "180", secret=TEST_SECRET)
        yield Targets(worker, url)
    finally:
        if router is not None:
            router.send_signal(signal.SIGINT)
            router.wait(30)
        assert not stop_server(worker)


scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([0, 1, -1, 2**31, 2**63, -(2**63) - 1, 2**64, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False),  # FTZ may be on (C kernels)
    st.sampled_from(["NaN", "Infinity", "-inf", "1e400", "\ud800", "\udfff", "", "x" * 300]),
    st.text(max_size=40),
)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)), max_leaves=12)
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p",
          "top_k", "min_p", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "stream",
          "stream_options", "repetition_penalty", "presence_penalty", "min_tokens", "tools", "tool_choice",
          "response_format", "cache_salt", "kv_transfer_params", "return_token_ids", "echo", "best_of",
          "logit_bias", "tokens", "transfer_id", "ignore_eos", "skip_special_tokens", "suffix"]
FORGED = {"do_remote_prefill": True, "first_token_ids": [99_999_999], "transfer_id": "victim", "host": "127.0.0.1",
          "port": 9, "block_hashes": [1, 2], "shm_path": "/dev/shm/x", "extra": {"block_ids": [0]}}


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["mutated", "mutated", "random", "raw"]))
    if kind == "raw":
        return draw(st.sampled_from([
            b"", b"{", b"[]", b"null", b'{"model": NaN}', b'{"temperature": Infinity, "prompt": "x"}',
            b'{"prompt": "\\ud800"}', b'{"messages": [{"role": "user", "content": "\\udc00x"}]}',
            b"\xff\xfe", b'{"prompt": "x", "max_tokens": 1e400}', b"[" * 5000 + b"]" * 5000,
            json.dumps({**COMPLETION, "kv_transfer_params": FORGED}).encode(),
        ]))
    if kind == "random":
        return json.dumps(draw(json_values)).encode()
    body = dict(draw(st.sampled_from([CHAT, COMPLETION])))
    for _ in range(draw(st.integers(1, 4))):
        field = draw(st.sampled_from(FIELDS))
        body[field] = FORGED if field == "kv_transfer_params" and draw(st.booleans()) else draw(json_values)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # keep a valid case short (the context is 64 tokens anyway)
    body["stream"] = body.get("stream") if isinstance(body.get("stream"), bool) else False
    return json.dumps(body).encode()


headers = st.dictionaries(
    st.sampled_from(["authorization", "x-tandem-peer", "content-type", "x-session-affinity", "anthropic-version"]),
    st.one_of(st.sampled_from(["Bearer", "Bearer x", f"Bearer {TEST_SECRET}", "Basic abc", "v1 1 2 3",
                               "v1 1700000000.0 " + "a" * 32 + " " + "b" * 64, "application/json", "text/plain"]),
              # (HTTP itself forbids a value's leading and trailing blanks: the client would refuse it)
              st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40).map(str.strip)),
    max_size=3)


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), post=st.booleans(), body=bodies(), extra=headers, via_router=st.booleans())
def test_no_request_makes_a_5xx_or_kills_an_engine(targets: Targets, path: str, post: bool, body: bytes,
                                                   extra: dict[str, str], via_router: bool) -> None:
    base = targets.router if via_router else targets.worker.url
    request_headers = {"content-type": "application/json", **extra}
    with httpx.Client(timeout=180) as client:
        if post:
            _check(client.post(f"{base}{path}", content=body, headers=request_headers))
        else:
            _check(client.get(f"{base}{path}", headers=request_headers))


def test_after_the_hostile_clients_both_still_serve_holding_nothing(targets: Targets) -> None:
    reply = httpx.post(f"{targets.router}/v1/chat/completions", json=CHAT, timeout=180)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
    load = targets.worker.wait_idle(timeout=60)
    assert load["kv_blocks_used"] == 0 and load["num_requests_in_flight"] == 0
    assert "engine core process exited" not in targets.worker.log()
