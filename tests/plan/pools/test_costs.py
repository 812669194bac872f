"""The step cost model: its features, the least-squares fit, and its file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.plan.pools.costs import CostModel, Measurement, StepShape


def test_features_count_tokens_attention_pairs_and_sequences() -> None:
    shape = StepShape(prefill=((100, 0), (10, 50)), decode_contexts=(7, 9))
    one, prompt, decode, prompt_pairs, decode_pairs, sequences = shape.features()
    assert (one, prompt, decode, sequences) == (1.0, 110.0, 2.0, 4.0)
    assert prompt_pairs == 100 * 50.5 + 10 * (50 + 5.5) and decode_pairs == 8 + 10


def test_fit_recovers_the_costs_that_made_the_steps() -> None:
    truth = CostModel(0.03, 0.0005, 0.0002, 2e-8, 9e-8, 0.001)
    shapes = [StepShape(((n, c),)) for n in (16, 128, 512, 2048) for c in (0, 1024)]
    shapes += [StepShape((), (c,) * b) for b in (1, 4, 16) for c in (128, 2048)]
    fitted = CostModel.fit([Measurement(s, truth.step_s(s)) for s in shapes])
    for name in ("fixed_s", "per_prompt_token_s", "per_decode_token_s", "per_prompt_pair_s", "per_decode_pair_s",
                 "per_sequence_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6), name


def test_fit_never_returns_a_negative_cost() -> None:
    # steps that get cheaper with more sequences: least squares would say d < 0
    shapes = [StepShape((), (100,) * b) for b in (1, 2, 4, 8)] + [StepShape(((n, 0),)) for n in (64, 256)]
    seconds = [0.05, 0.049, 0.048, 0.047, 0.08, 0.2]
    fitted = CostModel.fit([Measurement(s, t) for s, t in zip(shapes, seconds, strict=True)])
    assert min(fitted.coefficients) >= 0
    assert fitted.fixed_s > 0.04


def test_too_few_measurements_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 6"):
        CostModel.fit([Measurement(StepShape(((1, 0),)), 0.1)] * 5)


def test_a_profile_round_trips_and_a_bad_file_is_named(tmp_path: Path) -> None:
    model = CostModel(0.03, 0.0005, 0.0002, 2e-8, 9e-8, 0.001, transfer_s_per_token=4e-6, transfer_fixed_s=0.001,
                      http_overhead_s=0.0007, meta={"model": "m"})
    model.save(tmp_path / "p.json")
    assert CostModel.load(tmp_path / "p.json") == model
    assert model.transfer_s(1000) == pytest.approx(0.001 + 0.004)
    (tmp_path / "bad.json").write_text(json.dumps({"fixed": 1}))
    with pytest.raises(ValueError, match="bad.json is not a profile"):
        CostModel.load(tmp_path / "bad.json")


@pytest.mark.parametrize(("meta", "block_size"), [
    ({"block_size": 64}, 64),
    ({}, 16),  # a profile from before the field: engines then took blocks of 16
    ({"block_size": 0}, 16),
    ({"block_size": True}, 16),
    ({"block_size": "64"}, 16),
])
def test_a_profile_says_its_engines_block_size(meta: dict, block_size: int) -> None:
    assert CostModel(0.03, 0.0005, 0.0002, 2e-8, 9e-8, 0.001, meta=meta).block_size == block_size
