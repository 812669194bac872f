"""Pricing, API keys and the usage ledger without a router: arithmetic, files, the writer."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from tandem.edge.errors import APIError
from tandem.router.accounting.accounting import Accounting, status_name
from tandem.router.accounting.auth import (
    ApiKeyMiddleware,
    ApiKeys,
    caller_of,
    parse_api_keys,
    read_api_keys,
    worker_headers,
)
from tandem.router.accounting.ledger import Ledger, Totals, UsageRow
from tandem.router.accounting.pricing import (
    FREE,
    Price,
    PriceTable,
    cost,
    parse_price_data,
    read_price_file,
    usage_cost,
)
from tandem.router.accounting.usage_api import iso, parse_time, whose
from tandem.router.pd.merge import ChunkRewriter, Identity

SMOL = Price(input=0.10, cached_input=0.025, output=0.40)


# --- cost arithmetic -------------------------------------------------------------------
def test_cost_prices_uncached_cached_and_output_tokens_apart() -> None:
    # 1000 prompt tokens of which 600 cached, 200 generated.
    out = cost(1000, 600, 200, SMOL)
    assert out == {
        "input": pytest.approx(400 * 0.10 / 1e6),
        "cached_input": pytest.approx(600 * 0.025 / 1e6),
        "output": pytest.approx(200 * 0.40 / 1e6),
        "total": pytest.approx((400 * 0.10 + 600 * 0.025 + 200 * 0.40) / 1e6),
        "currency": "USD",
    }
    # One million of each kind costs exactly the per-1M prices.
    million = cost(2_000_000, 1_000_000, 1_000_000, SMOL)
    assert (million["input"], million["cached_input"], million["output"]) == (0.1, 0.025, 0.4)
    assert million["total"] == 0.525


def test_cost_clamps_cached_tokens_to_the_prompt_and_free_is_zero() -> None:
    assert cost(10, 50, 0, SMOL)["cached_input"] == pytest.approx(10 * 0.025 / 1e6)
    assert cost(10, 50, 0, SMOL)["input"] == 0
    assert cost(123, 45, 67, FREE)["total"] == 0


def test_usage_cost_reads_openai_usage() -> None:
    usage = {
        "prompt_tokens": 50,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    assert usage_cost(usage, SMOL) == cost(50, 32, 5, SMOL)
    assert usage_cost({"prompt_tokens": 7}, SMOL)["input"] == pytest.approx(0.7e-6)


# --- the price file --------------------------------------------------------------------
def test_price_file_json_yaml_patterns_and_default(tmp_path: Path) -> None:
    json_file = tmp_path / "prices.json"
    json_file.write_text(
        '{"smollm2-135m": {"input": 0.10, "cached_input": 0.025, "output": 0.40},'
        ' "*": {"input": 1, "output": 2}, "llama-*": {"input": 0.2, "output": 0.8}}'
    )
    table = read_price_file(json_file)
    assert table.price("smollm2-135m") == SMOL
    assert table.price("llama-3b") == Price(0.2, 0.2, 0.8)  # cached_input defaults to input
    assert table.price("other") == Price(1.0, 1.0, 2.0)  # "*" last, whatever its place
    yaml_file = tmp_path / "prices.yaml"
    yaml_file.write_text("smollm2-135m:\n  input: 0.10\n  cached_input: 0.025\n  output: 0.40\n")
    table = read_price_file(yaml_file)
    assert table.price("smollm2-135m") == SMOL
    assert table.price("unknown") == FREE  # no "*": unknown models are free
    assert PriceTable().price("x") == FREE


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], "must map model names to prices"),
        ({"m": 0.1}, "model 'm': expected {input, cached_input, output}"),
        ({"m": {"input": 0.1, "ouput": 0.4}}, "unknown key(s) ouput"),
        ({"m": {"input": -1}}, "input must be a finite number >= 0"),
        ({"m": {"output": "cheap"}}, "output must be a number"),
        ({"m": {"input": True}}, "input must be a number"),
    ],
)
def test_price_file_errors_are_clear(data: object, message: str) -> None:
    with pytest.raises(ValueError, match="the price file") as caught:
        parse_price_data(data)
    assert message in str(caught.value)


def test_price_file_syntax_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "prices.json"
    bad.write_text('{"m": {"input": 0.1,}}')
    with pytest.raises(ValueError, match=r"price file .*prices.json is not valid JSON"):
        read_price_file(bad)
    with pytest.raises(ValueError, match="price file not found"):
        read_price_file(tmp_path / "missing.json")


# --- API keys --------------------------------------------------------------------------
def test_key_files_in_three_formats(tmp_path: Path) -> None:
    lines = tmp_path / "keys.txt"
    lines.write_text("# team keys\nsk-alice-1 alice\n\nsk-alice-2 alice  # rotated\nsk-bob bob\n")
    keys = read_api_keys(lines)
    assert len(keys) == 3 and keys.identities == {"alice", "bob"}
    assert keys.identify("Bearer sk-alice-2") == "alice"
    assert keys.identify("bearer  sk-bob ") == "bob"
    assert keys.identify("Bearer sk-nope") is None
    assert keys.identify("sk-bob") is None and keys.identify(None) is None
    assert parse_api_keys('{"k1": "a"}', ".json").identify("Bearer k1") == "a"
    assert parse_api_keys("k1: a\nk2: b\n", ".yaml").identify("Bearer k2") == "b"
    assert parse_api_keys('{"k1": "a"}', "").identify("Bearer k1") == "a"  # JSON by content


@pytest.mark.parametrize(
    ("text", "suffix", "message"),
    [
        ("k1 alice extra\n", "", "line 1: expected `KEY IDENTITY`, got 3 field(s)"),
        ("k1\n", "", "line 1: expected `KEY IDENTITY`, got 1 field(s)"),
        ("k1 a\nk1 b\n", "", "line 2: the same key appears twice"),
        ("# nothing\n", "", "holds no keys"),
        ('{"k1": 5}', ".json", "the identity must be a non-empty string"),
        ('["k1"]', ".json", "must map keys to identities"),
    ],
)
def test_key_file_errors_are_clear(text: str, suffix: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_api_keys(text, suffix)
    assert message in str(caught.value)


def test_what_workers_receive() -> None:
    client = {"authorization": "Bearer client-key", "x-other": "1"}
    # No router keys: pass-through (a keyless router in front of keyed workers).
    assert worker_headers(client, keys_on=False, worker_api_key=None) == {
        "authorization": "Bearer client-key"
    }
    assert worker_headers({}, keys_on=False, worker_api_key=None) == {}
    # Router keys: the client's key is the router's secret and stays here.
    assert worker_headers(client, keys_on=True, worker_api_key=None) == {}
    # A worker key replaces whatever the client sent, with or without router keys.
    for keys_on in (False, True):
        assert worker_headers(client, keys_on, "wk") == {"authorization": "Bearer wk"}


def test_an_x_api_key_is_a_key_like_a_bearer_one() -> None:
    """Anthropic's clients (Claude Code) send `x-api-key`: the router's key check and what a
    keyless router passes to keyed workers treat it as `Authorization: Bearer`."""
    anthropic_client = {"x-api-key": "client-key"}
    assert worker_headers(anthropic_client, keys_on=False, worker_api_key=None) == {
        "authorization": "Bearer client-key"
    }
    assert worker_headers(anthropic_client, keys_on=True, worker_api_key=None) == {}
    both = {"authorization": "Bearer first", "x-api-key": "second"}
    assert worker_headers(both, keys_on=False, worker_api_key=None) == {"authorization": "Bearer first"}
    keys = parse_api_keys("sk-alice alice\n", ".txt")
    app = ApiKeyMiddleware(_identity_app, keys)
    assert _asgi_get(app, {"x-api-key": "sk-alice"}) == (200, "alice")
    assert _asgi_get(app, {"authorization": "Bearer sk-alice"}) == (200, "alice")
    assert _asgi_get(app, {"x-api-key": "sk-wrong"})[0] == 401
    assert _asgi_get(app, {"x-api-key": ""})[0] == 401
    assert _asgi_get(app, {})[0] == 401


async def _identity_app(scope, receive, send) -> None:  # noqa: ANN001
    await PlainTextResponse(caller_of(Request(scope, receive)))(scope, receive, send)


def _asgi_get(app: Any, headers: dict[str, str]) -> tuple[int, str]:
    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
            return await client.post("/v1/messages", headers=headers, content=b"{}")

    response = asyncio.run(call())
    return response.status_code, response.text


# --- /v1/usage parameters --------------------------------------------------------------
def test_parse_time_accepts_iso_and_unix() -> None:
    assert parse_time("1767225600", "start") == 1767225600.0
    assert parse_time("1767225600.5", "start") == 1767225600.5
    assert parse_time("2026-01-01T00:00:00Z", "start") == 1767225600.0
    assert parse_time("2026-01-01T01:00:00+01:00", "start") == 1767225600.0
    assert parse_time("2026-01-01", "start") == 1767225600.0  # naive: UTC
    assert iso(1767225600.25) == "2026-01-01T00:00:00.250Z"
    for bad in ("yesterday", "nan", "2026-13-01"):
        with pytest.raises(APIError) as caught:
            parse_time(bad, "end")
        assert caught.value.status == 400 and caught.value.message.startswith("end")


def test_who_may_read_whose_usage() -> None:
    open_router = Accounting()
    assert whose(open_router, "anonymous", None) is None  # everyone
    assert whose(open_router, "anonymous", "alice") == "alice"
    keyed = Accounting(keys=ApiKeys.from_mapping({"k": "alice"}), usage_admins=frozenset({"ops"}))
    assert whose(keyed, "alice", None) == "alice"
    assert whose(keyed, "alice", "alice") == "alice"
    with pytest.raises(APIError) as caught:
        whose(keyed, "alice", "bob")
    assert caught.value.status == 403 and caught.value.code == "permission_denied"
    assert whose(keyed, "ops", "bob") == "bob" and whose(keyed, "ops", "*") is None


# --- the ledger ------------------------------------------------------------------------
def _row(identity: str = "alice", at: float = 1000.0, **changes: object) -> UsageRow:
    row = UsageRow(
        time=at,
        identity=identity,
        user=None,
        model="m",
        endpoint="chat",
        request_id="chatcmpl-x",
        route="pd",
        prefill_worker="http://p",
        decode_worker="http://d",
        status="ok",
        http_status=200,
        prompt_tokens=50,
        cached_tokens=32,
        completion_tokens=5,
        estimated=False,
        cost_input=1.0,
        cost_cached_input=0.5,
        cost_output=0.25,
        cost_total=1.75,
    )
    return replace(row, **changes)  # type: ignore[arg-type]


def test_close_writes_every_queued_row(tmp_path: Path) -> None:
    batches: list[tuple[int, bool]] = []
    ledger = Ledger(tmp_path / "l.sqlite3", on_batch=lambda n, ok: batches.append((n, ok)))
    ledger.start()

    def writer(name: str) -> None:
        for i in range(2000):
            ledger.record(_row(name, at=1000.0 + i, completion_tokens=i))

    threads = [threading.Thread(target=writer, args=(f"id{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ledger.close()  # right away: the rows are still queued
    with sqlite3.connect(tmp_path / "l.sqlite3") as db:
        count, completion = db.execute(
            "SELECT COUNT(*), SUM(completion_tokens) FROM usage"
        ).fetchone()
    assert count == 8000 and completion == 4 * sum(range(2000))
    assert all(ok for _, ok in batches) and sum(n for n, _ in batches) == 8000
    assert len(batches) < 8000  # batched: many rows per transaction


def test_rows_after_close_are_written_not_dropped(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.sqlite3").start()
    ledger.record(_row())
    ledger.close()
    ledger.record(_row("late"))  # e.g. a stream cancelled at the shutdown deadline
    totals = ledger.totals(0, 2000)
    assert set(totals) == {"alice", "late"}


def test_totals_by_identity_user_and_time_range(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.sqlite3").start()
    ledger.record(_row("alice", at=100.0, user="u1"))
    ledger.record(_row("alice", at=200.0, status="aborted", estimated=True))
    ledger.record(_row("bob", at=200.0, status="error", prompt_tokens=0, cost_total=0.0))
    ledger.record(_row("bob", at=300.0))
    assert ledger.flush(5)
    everyone = ledger.totals(0, 1000)
    assert everyone["alice"] == Totals(2, 1, 0, 100, 64, 10, 2.0, 1.0, 0.5, 3.5)
    assert everyone["bob"].requests == 2 and everyone["bob"].errors == 1
    assert everyone["bob"].prompt_tokens == 50
    window = ledger.totals(150, 300)  # start inclusive, end exclusive
    assert {k: v.requests for k, v in window.items()} == {"alice": 1, "bob": 1}
    assert set(ledger.totals(0, 1000, identity="bob")) == {"bob"}
    assert ledger.totals(0, 1000, user="u1")["alice"].requests == 1
    assert ledger.first_time() == 100.0
    ledger.close()


def test_status_names() -> None:
    assert [status_name(s) for s in (200, 499, 400, 502)] == ["ok", "aborted", "error", "error"]


def test_stream_usage_gets_the_price() -> None:
    accounting = Accounting(prices=PriceTable({"m": SMOL}))
    identity = Identity.new("chat", "m")
    rewriter = ChunkRewriter(
        identity,
        include_usage=True,
        drop_role=True,
        prefill_usage={"prompt_tokens": 50, "prompt_tokens_details": {"cached_tokens": 32}},
        on_usage=accounting.pricer("m"),
    )
    out = rewriter(
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 50,
                "completion_tokens": 5,
                "total_tokens": 55,
                "prompt_tokens_details": {"cached_tokens": 48},  # the decode worker's: ignored
            },
        }
    )
    assert out is not None
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert out["usage"]["cost"] == cost(50, 32, 5, SMOL)
    assert rewriter.usage == out["usage"]
