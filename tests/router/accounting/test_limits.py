"""Token buckets, the daily quota and the admission queue on a fake clock / a bare loop."""

from __future__ import annotations

import asyncio

import pytest

from tandem.edge.errors import APIError
from tandem.router.accounting.auth import Caller
from tandem.router.accounting.keys_store import KeyLimits, key_id, new_key
from tandem.router.accounting.limits import DailyQuota, RateLimiter, day_start
from tandem.router.config import AdmissionPolicy
from tandem.router.resilience.admission import AdmissionQueue


def test_request_bucket_bursts_then_refills_at_its_rate() -> None:
    limiter = RateLimiter(KeyLimits(rpm=60))  # the router's default for keys without their own
    caller = Caller("alice", "k1")
    for i in range(60):
        limiter.admit(caller, 0, now=100.0 + i * 0.001)
    with pytest.raises(APIError) as refused:
        limiter.admit(caller, 0, now=100.1)
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
    limiter.admit(caller, 0, now=101.2)  # one a second comes back
    other = Caller("bob", "k2", KeyLimits(rpm=1000))
    limiter.admit(other, 0, now=101.2)  # its own bucket, its own limit


def test_token_bucket_admits_until_in_debt_and_the_debt_sets_retry_after() -> None:
    limiter = RateLimiter(KeyLimits())
    caller = Caller("bob", "k", KeyLimits(tpm=600))  # 10 a second
    limiter.admit(caller, 500, now=0.0)
    limiter.charge(caller, 300, now=1.0)  # 600 - 500 + 10 - 300 = -190
    with pytest.raises(APIError) as refused:
        limiter.admit(caller, 10, now=1.0)
    assert refused.value.code == "rate_limit_tokens"
    assert refused.value.headers["Retry-After"] == "20"  # 190 / 10, rounded up
    limiter.admit(caller, 10, now=21.0)


def test_daily_quota_counts_the_ledger_and_this_router_and_resets_at_midnight() -> None:
    reads: list[tuple[str, float]] = []

    def ledger_tokens(identity: str, start: float, end: float) -> int:
        reads.append((identity, start))
        assert end == start + 86400
        return 90 if len(reads) == 1 else 60  # another router's rows, say, or a new day

    quota = DailyQuota(KeyLimits(tokens_per_day=100), ledger_tokens, refresh_s=10.0)
    caller = Caller("carol", "k")
    noon = day_start(1_700_000_000.0) + 43200
    asyncio.run(quota.check(caller, now=noon))
    quota.charge("carol", 15)
    with pytest.raises(APIError) as refused:
        asyncio.run(quota.check(caller, now=noon + 1))
    assert refused.value.code == "quota_exceeded" and "105 of 100" in refused.value.message
    assert refused.value.headers["Retry-After"] == str(43200 - 1)
    assert len(reads) == 1  # cached between refreshes
    asyncio.run(quota.check(caller, now=noon + 11))  # re-read: the ledger's sum replaces both
    assert len(reads) == 2
    asyncio.run(quota.check(Caller("dan", "k2", KeyLimits(tokens_per_day=10**6)), now=noon))


def test_new_keys_name_their_entry_and_refuse_bad_identities() -> None:
    key, entry = new_key("alice", KeyLimits(rpm=5), set())
    assert key_id(key) == entry.id and entry.matches(key) and not entry.matches(key + "x")
    assert key not in str(entry.to_json())
    with pytest.raises(ValueError):
        new_key("two words", KeyLimits(), set())
    with pytest.raises(ValueError):
        KeyLimits(rpm=0)


def test_admission_queue_hands_slots_on_in_order_and_drops_cancelled_waiters() -> None:
    async def scenario() -> list[str]:
        queue = AdmissionQueue(AdmissionPolicy(max_in_flight=1, max_queue=2, queue_timeout_s=5))
        await queue.enter()
        order: list[str] = []

        async def wait(name: str) -> None:
            await queue.enter()
            order.append(name)

        gone = asyncio.create_task(wait("gone"))
        second = asyncio.create_task(wait("second"))
        await asyncio.sleep(0.01)
        with pytest.raises(APIError) as full:
            await queue.enter()
        assert full.value.status == 429
        gone.cancel()  # a client that left while waiting
        await asyncio.sleep(0.01)
        queue.leave()
        await second
        queue.leave()
        assert queue.in_flight == 0 and queue.waiting == 0
        return order

    assert asyncio.run(scenario()) == ["second"]
