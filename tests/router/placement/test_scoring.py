"""Token scores without processes: which worker the prefill and decode scores pick, and the
prompt token count they are fed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tandem.router.config import HealthPolicy, WorkerSpec
from tandem.router.placement.prompt_tokens import PromptCounter
from tandem.router.placement.scoring import decode_score, pick_decode, pick_prefill, prefill_score
from tandem.router.workers.registry import LoadSnapshot, WorkerRegistry
from tests.support.router_helpers import healthy_worker

POLICY = HealthPolicy()


# --- scoring ---------------------------------------------------------------------------
def test_prefill_picks_the_worker_with_fewer_queued_tokens_not_fewer_requests() -> None:
    # a: one huge queued prompt; b: many small ones. Tokens decide, not request counts.
    a = healthy_worker("http://a", "prefill", num_waiting_prefill_tokens=8000, num_waiting_requests=1)
    b = healthy_worker("http://b", "prefill", num_waiting_prefill_tokens=600, num_waiting_requests=12)
    assert pick_prefill([a, b], prompt_tokens=500) is b
    assert prefill_score(a, 500) == 8500 and prefill_score(b, 500) == 1100


def test_prefill_counts_tokens_routed_since_the_last_poll() -> None:
    a = healthy_worker("http://a", "prefill", num_waiting_prefill_tokens=100)
    b = healthy_worker("http://b", "prefill", num_waiting_prefill_tokens=300)
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
    a = healthy_worker("http://a", "prefill")
    handle = a.dispatch("prefill", 700, now=1.0)
    assert prefill_score(a, 0) == 700
    a.settle(handle)
    assert prefill_score(a, 0) == 0


def test_decode_score_is_the_kv_fraction_plus_a_sequence_term() -> None:
    # a: bigger cache, more tokens, but a lower fraction in use.
    a = healthy_worker(
        "http://a",
        running_kv_tokens=4000,
        kv_blocks_total=1000,
        block_size=16,
        num_running_requests=4,
    )
    b = healthy_worker(
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
