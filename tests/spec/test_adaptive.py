"""The adaptive lookahead rule: speculate where a token is cheap and likely, not elsewhere."""

from __future__ import annotations

import pytest

from tandem.spec.adaptive import (
    AcceptanceTracker,
    StepCostModel,
    choose_lookahead,
    expected_tokens_per_step,
)


def cost(fixed: float, per_token: float) -> StepCostModel:
    model = StepCostModel(decay=1.0)
    for tokens in (1, 2, 4, 8, 16, 32):
        model.observe(tokens, fixed + per_token * tokens)
    return model


def test_the_cost_model_recovers_a_linear_step_time() -> None:
    fixed, per_token = cost(0.020, 0.0005).coefficients()
    assert fixed == pytest.approx(0.020)
    assert per_token == pytest.approx(0.0005)
    single_size = StepCostModel()
    single_size.observe(1, 0.02)
    assert single_size.coefficients()[1] == pytest.approx(single_size.coefficients()[0] * 0.02)


def test_batch_one_with_good_acceptance_speculates_deep() -> None:
    chosen = choose_lookahead({"a": 0.8}, {"a": 8}, base_tokens=1, num_sampling=1,
                              cost=cost(0.020, 0.0005), budget=100)
    assert chosen == {"a": 8}


def test_the_bar_rises_with_the_batch_until_nothing_pays() -> None:
    model = cost(0.020, 0.0005)
    small = choose_lookahead({"a": 0.8}, {"a": 8}, 1, 1, model, 100)
    rates = {f"r{i}": 0.8 for i in range(64)}
    caps = dict.fromkeys(rates, 8)
    large = choose_lookahead(rates, caps, 64, 64, model, 10_000)
    many = {f"r{i}": 0.8 for i in range(512)}
    compute_bound = choose_lookahead(many, dict.fromkeys(many, 8), 512, 512, model, 10_000)
    assert small["a"] >= 4
    assert 0 < sum(large.values()) < 64 * small["a"]
    assert compute_bound == {}


def test_likelier_requests_get_their_tokens_first_and_the_budget_is_kept() -> None:
    chosen = choose_lookahead({"good": 0.9, "poor": 0.2}, {"good": 8, "poor": 8}, 2, 2,
                              cost(0.020, 0.002), budget=100)
    assert chosen["good"] > chosen.get("poor", 0)
    limited = choose_lookahead({"a": 0.9, "b": 0.9}, {"a": 8, "b": 8}, 2, 2, cost(0.02, 0.0001), budget=5)
    assert sum(limited.values()) == 5


def test_a_failing_request_drops_to_the_floor_and_a_good_one_rises() -> None:
    tracker = AcceptanceTracker()
    for _ in range(20):
        tracker.observe("prose", 4, 0)
        tracker.observe("code", 4, 4)
    assert tracker.rate("prose") < 0.2
    assert tracker.rate("code") > 0.9
    assert tracker.rate("new") == pytest.approx(tracker.global_rate())
    tracker.forget("code")
    assert tracker.rate("code") == pytest.approx(tracker.global_rate())


def test_leviathan_expected_tokens() -> None:
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)


def test_a_request_passed_over_drifts_back_to_trying() -> None:
    tracker = AcceptanceTracker()
    for _ in range(8):
        tracker.observe("r", 4, 0)
    low = tracker.rate("r")
    for _ in range(40):
        tracker.passed_over("r")
        tracker.nobody_tried()
    assert low < 0.2
    assert tracker.rate("r") > 0.4  # back near the prior: worth a probe again where the bar is ~0.3
