"""The circuit breaker's states and the retry budget's arithmetic, on a fake clock."""

from __future__ import annotations

import pytest

from tandem.router.config import BreakerPolicy, RetryPolicy
from tandem.router.resilience.breaker import CircuitBreaker
from tandem.router.resilience.retry_budget import RetryBudget

POLICY = BreakerPolicy(failures=3, window_s=10.0, cooldown_s=5.0, max_cooldown_s=12.0)


def test_failures_within_the_window_open_it_and_older_ones_do_not_count() -> None:
    breaker = CircuitBreaker("w", POLICY)
    breaker.record_failure(0.0, "boom")
    breaker.record_failure(1.0, "boom")
    breaker.record_failure(11.5, "boom")  # the first two are out of the window now
    assert breaker.state == "closed" and breaker.allows(11.5)
    breaker.record_failure(12.0, "boom")
    assert breaker.state == "closed"
    breaker.record_failure(13.0, "boom")  # 11.5, 12, 13: three within 10 s
    assert breaker.state == "open" and breaker.trips == 1
    assert not breaker.allows(13.0) and not breaker.allows(17.9)


def test_half_open_lets_one_trial_through_and_its_result_decides() -> None:
    breaker = CircuitBreaker("w", POLICY)
    for t in (0.0, 0.1, 0.2):
        breaker.record_failure(t, "boom")
    assert breaker.allows(5.2) and breaker.state == "half_open"
    breaker.on_dispatch()
    assert not breaker.allows(5.3)  # the trial is out: nobody else
    breaker.record_failure(6.0, "still broken")
    assert breaker.state == "open" and breaker.trips == 2
    assert not breaker.allows(15.9)  # the cool-down doubled: 10 s from 6.0
    assert breaker.allows(16.0)
    breaker.on_dispatch()
    breaker.record_failure(16.5, "still broken")
    assert not breaker.allows(28.4) and breaker.allows(28.5)  # doubled again, capped at 12
    breaker.on_dispatch()
    breaker.record_success()
    assert breaker.state == "closed" and breaker.allows(28.6)
    for t in (30.0, 30.1, 30.2):  # a later trip starts from the shortest cool-down again
        breaker.record_failure(t, "boom")
    assert not breaker.allows(35.1) and breaker.allows(35.2)


def test_a_success_while_closed_does_not_erase_failures_and_open_ignores_late_ones() -> None:
    breaker = CircuitBreaker("w", POLICY)
    breaker.record_failure(0.0, "a")
    breaker.record_failure(0.5, "b")
    breaker.record_success()
    breaker.record_failure(1.0, "c")
    assert breaker.state == "open"
    breaker.record_failure(2.0, "sent before it opened")
    assert breaker.trips == 1 and breaker.allows(6.0)


def test_bad_breaker_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="breaker-failures"):
        BreakerPolicy(failures=0)
    with pytest.raises(ValueError, match="cool-down"):
        BreakerPolicy(cooldown_s=10.0, max_cooldown_s=5.0)


def test_retry_budget_is_a_share_of_requests_plus_a_floor_over_a_window() -> None:
    budget = RetryBudget(RetryPolicy(budget_ratio=0.2, budget_min_per_s=0.1, budget_window_s=10.0))
    for i in range(20):
        budget.on_request(i * 0.1)
    # 0.2 x 20 + 0.1 x 10 = 5 retries
    assert [budget.try_retry(2.0) for _ in range(6)] == [True] * 5 + [False]
    # 11 s later the window holds nothing: only the floor's one retry
    assert budget.try_retry(14.0) and not budget.try_retry(14.0)
    none = RetryBudget(RetryPolicy(budget_ratio=0.0, budget_min_per_s=0.0))
    none.on_request(0.0)
    assert not none.try_retry(0.0)


def test_reset_closes_it_with_the_shortest_cool_down() -> None:
    breaker = CircuitBreaker("w", POLICY)
    for t in (0.0, 0.1, 0.2):
        breaker.record_failure(t, "boom")
    breaker.allows(5.2)
    breaker.on_dispatch()
    breaker.record_failure(5.3, "down")
    breaker.reset("its /health is back")
    assert breaker.state == "closed" and breaker.allows(5.4)
    for t in (6.0, 6.1, 6.2):
        breaker.record_failure(t, "boom")
    assert not breaker.allows(11.1) and breaker.allows(11.3)  # 5 s, not the doubled 10 s
