"""A request whose step raises is stopped alone; the engine keeps stepping the others.

On the default model, in process: a request that got past every check asking for more
log-probabilities than the vocabulary has (the edge and the engine refuse that, so the test sets
it after the engine took the request) raises inside the real sampler (`topk` out of range). Alone, or batched with ordinary
greedy requests, it must end with an error delta while every other request finishes with the
very tokens a clean run gives it, and every KV block goes back to the pool. Each test runs with
asynchronous scheduling off and on: on, the failing step is submitted while the step before it
is still in flight, and that step's tokens must still reach their requests.
"""

from __future__ import annotations

import pytest

from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine_core import EngineCore, EngineCoreRequest
from tandem.types import CacheRetention, SamplingParams

PROMPTS = {
    "a": [1, 504, 3458, 282, 4118, 314, 2],
    "b": [1, 9, 1233, 28, 3458, 314, 16, 17, 18],
    "c": [1, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110],
}


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "async"])
def core(request: pytest.FixtureRequest) -> EngineCore:
    engine = EngineCore(EngineConfig("smollm2-135m", cache=CacheConfig(kv_cache_memory_bytes=64 << 20),
                                     scheduler=SchedulerConfig(async_scheduling=request.param)))
    assert engine.executor.runs_ahead == (request.param == "on")
    yield engine
    engine.shutdown()


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _run(core: EngineCore, poisoned: str | None = None, poison_after_steps: int = 0) -> tuple[dict, dict]:
    """Every prompt in PROMPTS, plus one poisoned request when asked; tokens and errors per id."""
    for request_id, prompt in PROMPTS.items():
        core.add_request(EngineCoreRequest(request_id, list(prompt), _greedy()))
    if poisoned is not None:
        params = SamplingParams(temperature=0.8, max_tokens=12, seed=3)
        core.add_request(EngineCoreRequest(poisoned, [1, 5, 6, 7, 8, 9], params))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in PROMPTS}
    errors: dict[str, str] = {}
    steps = 0
    while core.has_unfinished():
        if poisoned is not None and steps == poison_after_steps:
            # Past every check: what a bug in the edge would let through.
            core.scheduler.requests[poisoned].sampling_params.logprobs = 10**9
        for delta in core.step():
            if delta.error is not None:
                errors[delta.request_id] = delta.error
            for sequence in delta.sequences:
                tokens.setdefault(delta.request_id, []).extend(sequence.token_ids)
        steps += 1
        assert steps < 500
    assert core.block_pool.num_used_blocks == 0
    return tokens, errors


def test_a_raising_request_is_stopped_and_the_batch_it_shared_finishes_clean(core: EngineCore) -> None:
    clean, errors = _run(core)
    assert not errors and all(len(t) == 12 for t in clean.values())
    core.reset_prefix_cache()
    # Poisoned before its first step: its prefill (which samples) fails in a batch with the others.
    tokens, errors = _run(core, "bad", poison_after_steps=0)
    assert set(errors) == {"bad"} and "failed inside the engine" in errors["bad"]
    assert "RuntimeError" in errors["bad"]
    assert tokens.get("bad", []) == []
    assert {k: v for k, v in tokens.items() if k in PROMPTS} == clean
    core.reset_prefix_cache()
    # Poisoned mid-decode: it already has tokens; it is stopped there, the others are unharmed.
    tokens, errors = _run(core, "late", poison_after_steps=3)
    assert set(errors) == {"late"} and 0 < len(tokens["late"]) < 12
    assert {k: v for k, v in tokens.items() if k in PROMPTS} == clean
    # And the engine serves on.
    again, errors = _run(core)
    assert again == clean and not errors


def test_a_request_the_engine_cannot_take_is_refused_at_add(core: EngineCore) -> None:
    """The engine's own checks behind the edge: token ids outside the vocabulary (a peer's
    first-token handoff once killed the engine with [99999999]) and parameters out of range."""
    vocab = core.model_config.vocab_size
    bad = [
        EngineCoreRequest("x1", [1, 2, vocab], _greedy()),
        EngineCoreRequest("x2", [1, 2, 3], _greedy(), prior_output_ids=[99_999_999]),
        EngineCoreRequest("x3", [], _greedy()),
    ]
    for request in bad:
        with pytest.raises(ValueError):
            core.add_request(request)
    params = _greedy()
    params.top_k = vocab + 1
    with pytest.raises(ValueError):
        core.add_request(EngineCoreRequest("x4", [1, 2, 3], params))
    # A retention hint that skipped its constructor's checks (an unpickled message does).
    retention = object.__new__(CacheRetention)
    object.__setattr__(retention, "tokens", -5)
    object.__setattr__(retention, "seconds", float("nan"))
    for hint in (retention, "keep it"):
        with pytest.raises(ValueError, match="retention"):
            core.add_request(EngineCoreRequest("x5", [1, 2, 3], _greedy(), retention=hint))  # type: ignore[arg-type]
    assert not core.has_unfinished()
