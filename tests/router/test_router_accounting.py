"""Prices, API keys and the usage ledger through a router in front of fake workers."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.router.accounting.flags import check_accounting
from tandem.router.accounting.pricing import Price, cost
from tandem.router.config import (
    AccountingConfig,
    HealthPolicy,
    RetryPolicy,
    RouterConfig,
    Timeouts,
    WorkerSpec,
)
from tandem.router.http.app import build_app
from tests.support.router_helpers import (
    PROMPT_TOKENS,
    FakeWorker,
    ThreadServer,
    read_stream,
    wait_for,
)

FakeFactory = Callable[[str], tuple[FakeWorker, str]]
SECRET = "test-cluster-secret"  # the router's: it signs hops and opens the control plane
CHAT = {"model": "smol", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5}
COMPLETION = {"model": "smol", "prompt": "Say hello.", "max_tokens": 5}
SMOL = Price(input=0.10, cached_input=0.025, output=0.40)
KEYS = {"sk-alice": "alice", "sk-bob": "bob", "sk-carol": "carol", "sk-ops": "ops"}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Routers:
    """Routers on real ports that a test can stop itself (graceful shutdown, as Ctrl-C)."""

    def __init__(self, tmp_path: Path, fake_workers: FakeFactory) -> None:
        self.tmp_path = tmp_path
        self.fake_workers = fake_workers
        self.servers: list[ThreadServer] = []
        prices = tmp_path / "prices.json"
        prices.write_text(json.dumps({"smol": SMOL.__dict__, "*": {"input": 1.0}}))
        keys = tmp_path / "keys.txt"
        keys.write_text("".join(f"{k} {v}\n" for k, v in KEYS.items()))
        self.prices = prices
        self.keys = keys
        self.ledger = tmp_path / "usage.sqlite3"

    def start(
        self, keys: bool = True, pd: bool = True, **accounting: Any
    ) -> tuple[ThreadServer, FakeWorker, FakeWorker | None]:
        decode, decode_url = self.fake_workers("decode")
        workers = [WorkerSpec(decode_url, "decode" if pd else "both")]
        prefill = None
        if pd:
            prefill, prefill_url = self.fake_workers("prefill")
            workers.append(WorkerSpec(prefill_url, "prefill"))
        options: dict[str, Any] = {
            "prices_file": self.prices,
            "ledger_path": self.ledger,
            "api_keys_file": self.keys if keys else None,
            "usage_admins": ("ops",),
        }
        options.update(accounting)
        config = RouterConfig(
            workers=tuple(workers),
            health=HealthPolicy(interval_s=0.1, timeout_s=1.0),
            timeouts=Timeouts(connect_s=1.0, first_byte_s=5.0, idle_s=5.0),
            retry=RetryPolicy(max_attempts=3, backoff_s=0.01),
            pd_min_prompt_tokens=0,
            accounting=AccountingConfig(**options),
            cluster_secret=SECRET,
        )
        server = ThreadServer(build_app(config)).start()
        self.servers.append(server)
        return server, decode, prefill

    def rows(self) -> list[dict[str, Any]]:
        with sqlite3.connect(self.ledger) as db:
            db.row_factory = sqlite3.Row
            return [dict(r) for r in db.execute("SELECT * FROM usage ORDER BY id")]


@pytest.fixture
def routers(tmp_path: Path, fake_workers: FakeFactory) -> Iterator[Routers]:
    made = Routers(tmp_path, fake_workers)
    yield made
    for server in made.servers:
        server.stop()


def _usage_of(url: str, path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    """The usage the client saw: the body's, or a stream's final usage chunk."""
    if body.get("stream"):
        events: list[Any] = []
        with httpx.stream(
            "POST", f"{url}{path}", json=body, headers=_auth(key), timeout=30
        ) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        return events[-1]["usage"]
    reply = httpx.post(f"{url}{path}", json=body, headers=_auth(key), timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]


# --- cost in responses ---------------------------------------------------------------------
def test_every_response_carries_its_cost(routers: Routers) -> None:
    server, _, _ = routers.start(keys=False)
    url = server.url
    expected = cost(PROMPT_TOKENS, 32, 5, SMOL)  # PD: the prefill worker's 32 cached tokens
    whole = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30).json()["usage"]
    assert whole["prompt_tokens_details"]["cached_tokens"] == 32
    assert whole["cost"] == expected
    events = read_stream(url, {**CHAT, "stream_options": {"include_usage": True}})
    final = events[-2]
    assert isinstance(final, dict) and final["choices"] == []
    assert final["usage"]["cost"] == expected
    assert all(e.get("usage") is None for e in events[:-2] if isinstance(e, dict))
    plain = read_stream(url, CHAT)  # no include_usage: no usage, so no cost either
    assert not any("usage" in e for e in plain if isinstance(e, dict))
    completion = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=30).json()
    assert completion["usage"]["cost"] == expected
    other = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "model": "x"}, timeout=30)
    assert other.json()["usage"]["cost"]["input"] == pytest.approx((50 - 32) * 1.0 / 1e6)
    # direct (short prompt: max_tokens=1 skips the prefill hop): the decode worker's count
    direct = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 1}).json()
    assert direct["usage"]["cost"] == cost(PROMPT_TOKENS, 0, 1, SMOL)


# --- the ledger against the responses ------------------------------------------------------
def test_ledger_totals_equal_the_responses_after_a_concurrent_run(routers: Routers) -> None:
    server, _, _ = routers.start()
    usage_only = {"stream_options": {"include_usage": True}}
    shapes = [
        ("/v1/chat/completions", CHAT),
        ("/v1/chat/completions", {**CHAT, "stream": True, **usage_only}),
        ("/v1/completions", COMPLETION),
        ("/v1/completions", {**COMPLETION, "stream": True, **usage_only}),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 1}),  # direct
        ("/v1/chat/completions", {**CHAT, "max_tokens": 3, "model": "other"}),
    ]
    jobs = [
        (key, *shapes[i % len(shapes)])
        for i, key in enumerate(k for k in ("sk-alice", "sk-bob", "sk-carol") for _ in range(30))
    ]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda job: (job[0], _usage_of(server.url, *job[1:], job[0])), jobs))
    server.stop()  # graceful: the ledger is flushed at shutdown
    expected: dict[str, list[float]] = {}
    for key, usage in results:
        sums = expected.setdefault(KEYS[key], [0, 0, 0, 0, 0.0])
        sums[0] += 1
        sums[1] += usage["prompt_tokens"]
        sums[2] += usage["prompt_tokens_details"]["cached_tokens"]
        sums[3] += usage["completion_tokens"]
        sums[4] += usage["cost"]["total"]
    with sqlite3.connect(routers.ledger) as db:
        got = {
            row[0]: list(row[1:])
            for row in db.execute(
                "SELECT identity, COUNT(*), SUM(prompt_tokens), SUM(cached_tokens), "
                "SUM(completion_tokens), SUM(cost_total) FROM usage GROUP BY identity"
            )
        }
    assert set(got) == set(expected) == {"alice", "bob", "carol"}
    for identity, sums in expected.items():
        assert got[identity][:4] == sums[:4], identity
        assert got[identity][4] == pytest.approx(sums[4], rel=1e-9)
    rows = routers.rows()
    assert {r["status"] for r in rows} == {"ok"} and not any(r["estimated"] for r in rows)
    assert {r["route"] for r in rows} == {"pd", "direct"}
    pd_row = next(r for r in rows if r["route"] == "pd")
    assert pd_row["prefill_worker"] and pd_row["decode_worker"] and pd_row["cached_tokens"] == 32
    assert all(r["request_id"].startswith(("chatcmpl-", "cmpl-")) for r in rows)


def test_an_abandoned_stream_is_recorded_as_aborted(routers: Routers) -> None:
    server, worker, _ = routers.start(keys=False, pd=False)
    worker.behaviour.tokens = tuple(f" t{i}" for i in range(2000))
    body = {**CHAT, "max_tokens": 2000, "stream": True, "user": "end-user-7"}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(8):
            next(lines)
    assert wait_for(lambda: worker.disconnects == 1, timeout=5)

    def aborted() -> int:
        report = httpx.get(f"{server.url}/v1/usage", params={"user": "end-user-7"}).json()
        return report["total"]["aborted"]

    assert wait_for(lambda: aborted() == 1, timeout=5)
    (row,) = routers.rows()
    assert row["status"] == "aborted" and row["http_status"] == 499 and row["estimated"] == 1
    assert row["user"] == "end-user-7" and row["identity"] == "anonymous"
    assert 0 < row["completion_tokens"] < 2000 and row["prompt_tokens"] > 0


def _sse(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """A Messages or Responses stream's (event, data) pairs."""
    pairs = []
    for block in response.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines and lines["data"] != "[DONE]":
            pairs.append((lines.get("event", ""), json.loads(lines["data"])))
    return pairs


def test_messages_and_responses_are_priced_and_recorded_as_themselves(routers: Routers) -> None:
    """A Messages or Responses request is a chat request below the router's edge, but the
    ledger records it under the client's protocol and the id the client saw, and prices it
    with the cached tokens discounted, like a chat request."""
    server, _, _ = routers.start()
    url = server.url
    message = {"model": "smol", "max_tokens": 5, "messages": [{"role": "user", "content": "Say hello."}]}
    response = {"model": "smol", "max_output_tokens": 5, "input": "Say hello.", "store": False}
    seen: list[tuple[str, str, dict[str, Any]]] = []  # (endpoint, id the client saw, usage)
    alice = {"x-api-key": "sk-alice"}  # as Claude Code sends its key
    whole = httpx.post(f"{url}/v1/messages", json=message, headers=alice, timeout=30).json()
    seen.append(("messages", whole["id"], whole["usage"]))
    streamed = _sse(httpx.post(f"{url}/v1/messages", json={**message, "stream": True}, headers=alice, timeout=30))
    start = next(data for event, data in streamed if event == "message_start")
    final = next(data for event, data in streamed if event == "message_delta")
    seen.append(("messages", start["message"]["id"], {**start["message"]["usage"], **final["usage"]}))
    whole = httpx.post(f"{url}/v1/responses", json=response, headers=_auth("sk-bob"), timeout=30).json()
    seen.append(("responses", whole["id"], whole["usage"]))
    streamed = _sse(httpx.post(f"{url}/v1/responses", json={**response, "stream": True},
                               headers=_auth("sk-bob"), timeout=30))
    done = next(data for event, data in streamed if event == "response.completed")["response"]
    seen.append(("responses", done["id"], done["usage"]))
    server.stop()  # the ledger is flushed at shutdown
    rows = {row["request_id"]: row for row in routers.rows()}
    expected = cost(PROMPT_TOKENS, 32, 5, SMOL)  # PD: the prefill worker's 32 cached tokens
    for endpoint, reply_id, usage in seen:
        row = rows[reply_id]
        assert row["endpoint"] == endpoint and row["route"] == "pd" and row["status"] == "ok"
        assert (row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"]) == (PROMPT_TOKENS, 32, 5)
        assert row["cost_total"] == pytest.approx(expected["total"])
        assert row["identity"] == ("alice" if endpoint == "messages" else "bob")
        if endpoint == "messages":  # what the client was told, in Anthropic's terms
            assert reply_id.startswith("msg_") and usage["output_tokens"] == 5
            assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (PROMPT_TOKENS - 32, 32)
        else:
            assert reply_id.startswith("resp_") and usage["output_tokens"] == 5
            assert usage["input_tokens"] == PROMPT_TOKENS
            assert usage["input_tokens_details"]["cached_tokens"] == 32


def test_a_refused_key_is_answered_in_the_clients_protocol(routers: Routers) -> None:
    server, decode, _ = routers.start()
    hi = {"model": "smol", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        for headers in ({}, {"x-api-key": "sk-wrong"}, _auth("sk-wrong")):
            reply = httpx.post(f"{server.url}{path}", json=hi, headers=headers, timeout=30)
            assert reply.status_code == 401
            assert reply.json()["type"] == "error", reply.text
            assert reply.json()["error"]["type"] == "authentication_error"
    reply = httpx.post(f"{server.url}/v1/responses", json={"model": "smol", "input": "hi"}, timeout=30)
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"  # OpenAI's
    assert decode.requests == []


def test_a_stored_response_is_its_callers_alone(routers: Routers) -> None:
    """With keys on, a stored Responses conversation belongs to the identity that made it:
    another key can neither read it nor continue it, and is told no more than for an id never
    stored (404 either way)."""
    server, _, _ = routers.start()
    url = server.url
    body = {"model": "smol", "max_output_tokens": 5, "input": "Say hello."}
    stored = httpx.post(f"{url}/v1/responses", json=body, headers=_auth("sk-alice"), timeout=30)
    assert stored.status_code == 200, stored.text
    response_id = stored.json()["id"]
    own = httpx.get(f"{url}/v1/responses/{response_id}", headers=_auth("sk-alice"), timeout=30)
    assert own.status_code == 200 and own.json()["id"] == response_id
    never = httpx.get(f"{url}/v1/responses/resp_{'0' * 32}", headers=_auth("sk-bob"), timeout=30)
    other = httpx.get(f"{url}/v1/responses/{response_id}", headers=_auth("sk-bob"), timeout=30)
    assert other.status_code == never.status_code == 404
    assert other.json()["error"]["code"] == never.json()["error"]["code"] == "response_not_found"
    follow = {**body, "input": "And again.", "previous_response_id": response_id}
    stolen = httpx.post(f"{url}/v1/responses", json=follow, headers=_auth("sk-bob"), timeout=30)
    assert stolen.status_code == 404 and stolen.json()["error"]["code"] == "previous_response_not_found"
    continued = httpx.post(f"{url}/v1/responses", json=follow, headers=_auth("sk-alice"), timeout=30)
    assert continued.status_code == 200, continued.text
    deleted = httpx.delete(f"{url}/v1/responses/{response_id}", headers=_auth("sk-bob"), timeout=30)
    assert deleted.status_code == 404  # not bob's to delete
    deleted = httpx.delete(f"{url}/v1/responses/{response_id}", headers=_auth("sk-alice"), timeout=30)
    assert deleted.json() == {"id": response_id, "object": "response", "deleted": True}
    gone = httpx.get(f"{url}/v1/responses/{response_id}", headers=_auth("sk-alice"), timeout=30)
    assert gone.status_code == 404


# --- API keys ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "headers",
    [{}, _auth("sk-wrong"), {"Authorization": "Basic sk-alice"}, {"Authorization": "Bearer"}],
    ids=["none", "wrong", "basic", "empty"],
)
def test_v1_needs_a_valid_key(routers: Routers, headers: dict[str, str]) -> None:
    server, decode, prefill = routers.start()
    for method, path in [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/v1/usage"),
        ("GET", "/v1/nothing-here"),
    ]:
        reply = httpx.request(method, f"{server.url}{path}", json=CHAT, headers=headers)
        assert reply.status_code == 401, (path, reply.text)
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "invalid_api_key" and error["type"] == "authentication_error"
        assert reply.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key
    for path in ("/metrics", "/workers"):  # the operator's views close once keys are on...
        assert httpx.get(f"{server.url}{path}", headers=headers).status_code == 401, path
        assert httpx.get(f"{server.url}{path}", headers=_auth("sk-alice")).status_code == 401, path
        # ... and open to the admin key (here the cluster secret: no --admin-key was given)
        assert httpx.get(f"{server.url}{path}", headers=_auth(SECRET)).status_code == 200, path
    assert decode.requests == [] and prefill is not None and prefill.requests == []


def test_keys_map_to_identities_and_stay_at_the_router(routers: Routers) -> None:
    server, decode, prefill = routers.start()
    assert prefill is not None
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, headers=_auth("sk-bob"))
    assert reply.status_code == 200
    models = httpx.get(f"{server.url}/v1/models", headers=_auth("sk-bob"))
    assert models.status_code == 200
    # The client's key authenticated it to the router; the workers never see it.
    assert prefill.authorization == [None] and decode.authorization == [None]
    report = httpx.get(f"{server.url}/v1/usage", headers=_auth("sk-bob")).json()
    assert [d["identity"] for d in report["data"]] == ["bob"] and report["identity"] == "bob"
    metrics = httpx.get(f"{server.url}/metrics", headers=_auth(SECRET)).text
    assert 'tandem_router_ledger_rows_total{outcome="written"} 1.0' in metrics


def test_worker_api_key_is_what_workers_get(routers: Routers) -> None:
    server, decode, prefill = routers.start(worker_api_key="sk-worker")
    assert prefill is not None
    reply = httpx.post(
        f"{server.url}/v1/chat/completions", json=CHAT, headers=_auth("sk-alice"), timeout=30
    )
    assert reply.status_code == 200
    assert prefill.authorization == ["Bearer sk-worker"] == decode.authorization


# --- GET /v1/usage -------------------------------------------------------------------------
def test_usage_report_by_identity_and_time_range(routers: Routers) -> None:
    server, _, _ = routers.start()
    url = server.url

    def post(key: str, body: dict[str, Any] = CHAT) -> None:
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=_auth(key))
        assert reply.status_code == 200

    def report(key: str, **params: Any) -> httpx.Response:
        return httpx.get(f"{url}/v1/usage", params=params, headers=_auth(key))

    post("sk-alice")
    post("sk-alice", {**CHAT, "user": "u-1"})
    time.sleep(0.05)
    middle = time.time()
    time.sleep(0.05)
    post("sk-alice")
    post("sk-bob")
    mine = report("sk-alice").json()
    assert mine["identity"] == "alice" and [d["identity"] for d in mine["data"]] == ["alice"]
    one = cost(PROMPT_TOKENS, 32, 5, SMOL)
    assert mine["total"] == {
        "requests": 3,
        "aborted": 0,
        "errors": 0,
        "prompt_tokens": 3 * PROMPT_TOKENS,
        "cached_tokens": 3 * 32,
        "completion_tokens": 15,
        "cost": {
            "input": pytest.approx(3 * one["input"]),
            "cached_input": pytest.approx(3 * one["cached_input"]),
            "output": pytest.approx(3 * one["output"]),
            "total": pytest.approx(3 * one["total"]),
            "currency": "USD",
        },
    }
    assert mine["start"].endswith("Z") and mine["start_unix"] < middle < mine["end_unix"]
    assert report("sk-alice", start=middle).json()["total"]["requests"] == 1
    iso_middle = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(middle))
    since = report("sk-alice", start=iso_middle + f".{int(middle % 1 * 1e6):06d}Z").json()
    assert since["total"]["requests"] == 1
    assert report("sk-alice", end=middle).json()["total"]["requests"] == 2
    assert report("sk-alice", user="u-1").json()["total"]["requests"] == 1
    denied = report("sk-alice", identity="bob")
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "permission_denied"
    everyone = report("sk-ops", identity="*").json()
    assert {d["identity"]: d["requests"] for d in everyone["data"]} == {"alice": 3, "bob": 1}
    assert everyone["total"]["requests"] == 4
    assert report("sk-ops", identity="bob").json()["total"]["requests"] == 1
    assert report("sk-ops", identity="bob", end=middle).json()["data"] == []
    bad = report("sk-alice", start="last tuesday")
    assert bad.status_code == 400 and "start" in bad.json()["error"]["message"]
    assert report("sk-alice", start=middle + 10, end=middle).status_code == 400


def test_without_keys_usage_covers_everyone_and_no_ledger_is_404(routers: Routers) -> None:
    server, _, _ = routers.start(keys=False)
    httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, headers=_auth("sk-anything"))
    report = httpx.get(f"{server.url}/v1/usage").json()
    assert [d["identity"] for d in report["data"]] == ["anonymous"]
    off, _, _ = routers.start(keys=False, ledger_path=None)
    reply = httpx.get(f"{off.url}/v1/usage")
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "ledger_disabled"
    # ...and responses still carry their cost.
    priced = httpx.post(f"{off.url}/v1/chat/completions", json=CHAT, timeout=30).json()
    assert priced["usage"]["cost"] == cost(PROMPT_TOKENS, 32, 5, SMOL)


# --- the command line ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("prices.json", '{"m": {"input": 0.1, "ouput": 0.4}}', "unknown key(s) ouput"),
        ("prices.yaml", "m: [0.1]\n", "model 'm': expected {input, cached_input, output}"),
        ("keys.txt", "sk-1 alice extra\n", "line 1: expected `KEY IDENTITY`"),
    ],
)
def test_bad_files_are_refused_before_starting(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    flag = "prices_file" if name.startswith("prices") else "api_keys_file"
    with pytest.raises(ValueError) as caught:
        check_accounting(AccountingConfig(**{flag: path}))
    assert message in str(caught.value) and str(path) in str(caught.value)
    with pytest.raises(ValueError, match="cannot open the usage ledger"):
        check_accounting(AccountingConfig(ledger_path=path / "not-a-dir" / "l.sqlite3"))


def test_route_exits_with_the_error(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-1 alice extra\n")
    result = subprocess.run(
        [sys.executable, "-m", "tandem", "route", "--worker", "http://127.0.0.1:9"]
        + ["--api-keys", str(keys), "--ledger", str(tmp_path / "l.sqlite3")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert f"API key file {keys}, line 1: expected `KEY IDENTITY`" in result.stderr
