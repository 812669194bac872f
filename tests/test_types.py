"""Plain data types: SamplingParams validation and normalisation, Request bookkeeping."""

from __future__ import annotations

import pytest

from tandem.types import CompletionOutput, Request, RequestStatus, SamplingParams


def test_defaults_follow_vllm() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k) == (1, 1.0, 1.0, 0)
    assert (params.max_tokens, params.min_tokens, params.seed) == (16, 0, None)
    assert params.stop == [] and params.stop_token_ids == []
    assert not params.greedy and not params.has_penalties
    assert not params.ignore_eos and params.skip_special_tokens


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n", 0, "n must be"),
        ("n", 1.5, "n must be"),
        ("temperature", -0.1, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.01, "top_p"),
        ("min_p", -0.1, "min_p"),
        ("min_p", 1.5, "min_p"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("presence_penalty", 2.5, "presence_penalty"),
        ("presence_penalty", -2.5, "presence_penalty"),
        ("frequency_penalty", 2.01, "frequency_penalty"),
        ("frequency_penalty", -3, "frequency_penalty"),
        ("max_tokens", 0, "max_tokens"),
        ("min_tokens", -1, "min_tokens"),
        ("logprobs", -1, "logprobs"),
        ("logprobs", 21, "logprobs"),
        ("stop", [""], "stop strings"),
        ("stop", ["ok", ""], "stop strings"),
    ],
)
def test_invalid_values_are_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 4),
        ("temperature", 0.0),
        ("temperature", 2.0),
        ("top_p", 1.0),
        ("top_p", 1e-3),
        ("min_p", 0.0),
        ("min_p", 1.0),
        ("repetition_penalty", 1.3),
        ("presence_penalty", -2.0),
        ("presence_penalty", 2.0),
        ("frequency_penalty", 2.0),
        ("max_tokens", None),
        ("max_tokens", 1),
        ("logprobs", 0),
        ("logprobs", 20),
        ("seed", 0),
    ],
)
def test_boundary_values_are_accepted(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})
    assert getattr(params, field) == value


def test_negative_or_missing_top_k_means_disabled() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=None).top_k == 0
    assert SamplingParams(top_k=40).top_k == 40


def test_stop_is_normalised() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(5, 6)).stop_token_ids == [5, 6]


def test_validate_rechecks_after_mutation() -> None:
    params = SamplingParams()
    params.top_p = 0.0
    with pytest.raises(ValueError, match="top_p"):
        params.validate()


def test_greedy_and_penalties() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties
    assert SamplingParams(frequency_penalty=-0.5).has_penalties


def test_for_child() -> None:
    params = SamplingParams(n=3, seed=10, temperature=0.7, stop=["x"], max_tokens=5)
    children = [params.for_child(i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12]
    assert all(c.n == 1 and c.temperature == 0.7 and c.max_tokens == 5 for c in children)
    assert children[0].stop == ["x"]
    assert children[0].stop is not params.stop  # no list shared between siblings
    assert params.n == 3 and params.seed == 10  # the parent is untouched
    assert SamplingParams(n=2).for_child(1).seed is None


def test_request_token_bookkeeping() -> None:
    request = Request("r", [1, 2, 3], SamplingParams())
    assert request.all_token_ids == [1, 2, 3]
    assert request.all_token_ids is not request.prompt_token_ids
    assert (request.num_tokens, request.num_prompt_tokens, request.num_output_tokens) == (3, 3, 0)
    assert request.status == RequestStatus.WAITING
    assert request.num_computed_tokens == 0 and request.num_cached_tokens == -1
    request.append_output_token(9)
    assert request.all_token_ids == [1, 2, 3, 9] and request.output_token_ids == [9]
    assert request.prompt_token_ids == [1, 2, 3]
    assert (request.num_tokens, request.num_output_tokens) == (4, 1)


def test_request_built_with_outputs() -> None:
    request = Request("r", [1, 2], SamplingParams(), output_token_ids=[7])
    assert request.all_token_ids == [1, 2, 7]


def test_request_status_finished() -> None:
    finished = {s for s in RequestStatus if s.finished}
    assert finished == {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
    }
    # The values are the OpenAI finish_reason strings.
    assert RequestStatus.FINISHED_STOPPED.value == "stop"
    assert RequestStatus.FINISHED_LENGTH.value == "length"


def test_completion_output_finished() -> None:
    assert not CompletionOutput(0, "", []).finished
    assert CompletionOutput(0, "hi", [1], finish_reason="stop").finished


@pytest.mark.parametrize(("tokens", "seconds"), [(-1, 300.0), (1.5, 300.0), (True, 300.0), (10, -1.0),
                                                 (10, 3601.0), (10, float("nan")), (10, float("inf")),
                                                 (10, "300")])
def test_cache_retention_is_range_checked(tokens: object, seconds: object) -> None:
    from tandem.types import CacheRetention

    with pytest.raises(ValueError, match="cache retention"):
        CacheRetention(tokens, seconds)  # type: ignore[arg-type]


def test_cache_retention_takes_the_bounds() -> None:
    from tandem.types import CacheRetention

    assert CacheRetention(0, 0.0).seconds == 0.0
    assert CacheRetention(10**9, 3600).tokens == 10**9
