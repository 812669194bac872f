"""Asynchronous scheduling on the default model, in process: the same tokens as one step at a time.

With `async_scheduling="on"` the engine core keeps two steps in flight: it schedules and
submits step N+1 before it collects step N, and each decode whose input is the token step N
samples takes it from the runner's last samples (`SchedulerOutput.last_step_inputs`). On a
CPU nothing overlaps (the host is the device), but every piece of the path runs: the
scheduler's bookkeeping, the runner's gather of last-step tokens, the deferred results. Each
request must get exactly the tokens (and log-probabilities) the synchronous engine gives it,
whatever its sampling parameters, and every KV block must come back.
"""

from __future__ import annotations

import pytest

from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine_core import EngineCore, EngineCoreRequest
from tandem.types import SamplingParams

PROMPTS = [
    [1, 504, 3458, 282, 4118, 314],
    [1, 9, 1233, 28, 3458, 314, 16, 17, 18],
    [1, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110],
    [1, 2718, 314, 253, 1345],
]


def _engine(mode: str) -> EngineCore:
    return EngineCore(EngineConfig("smollm2-135m", cache=CacheConfig(kv_cache_memory_bytes=64 << 20),
                                   scheduler=SchedulerConfig(async_scheduling=mode)))


@pytest.fixture(scope="module")
def engines() -> dict[str, EngineCore]:
    made = {mode: _engine(mode) for mode in ("off", "on")}
    assert not made["off"].executor.runs_ahead and made["on"].executor.runs_ahead
    yield made
    for engine in made.values():
        engine.shutdown()


class Watched:
    """Records what each submitted step ran ahead on (observing the real executor)."""

    def __init__(self, core: EngineCore) -> None:
        self.ahead: list[list[str]] = []
        submit = core.executor.submit

        def watched(out):
            self.ahead.append(list(out.last_step_inputs))
            submit(out)

        core.executor.submit = watched


def _params() -> dict[str, SamplingParams]:
    return {
        "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        "short": SamplingParams(temperature=0, max_tokens=2),
        "eos": SamplingParams(temperature=0, max_tokens=40),
        "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=16),
        "penalised": SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3),
        "logprobs": SamplingParams(temperature=0, max_tokens=12, logprobs=3),
        "min": SamplingParams(temperature=0, max_tokens=12, min_tokens=6),
        "pair": SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=10),
        "stop": SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[28]),
    }


def _run(core: EngineCore, abort_after: int | None = None) -> dict:
    """Every parameter set on a prompt each; {(request, sequence): (tokens, logprobs, finish)}."""
    results: dict = {}
    for i, (name, params) in enumerate(_params().items()):
        core.add_request(EngineCoreRequest(name, list(PROMPTS[i % len(PROMPTS)]), params))
        for index in range(params.n):
            results[(name, index)] = ([], [], None)
    steps = 0
    while core.has_unfinished():
        if steps == abort_after:
            core.abort(["greedy"])
        for delta in core.step():
            for sequence in delta.sequences:
                tokens, logprobs, _ = results[(delta.request_id, sequence.index)]
                tokens.extend(sequence.token_ids)
                logprobs.extend(sequence.logprobs or [])
                results[(delta.request_id, sequence.index)] = (tokens, logprobs, sequence.finish_reason)
        steps += 1
        assert steps < 500
    assert core.block_pool.num_used_blocks == 0
    assert not core.scheduler._in_flight and not core.scheduler._sampling_in_flight
    return results


def test_every_request_gets_the_tokens_of_the_synchronous_engine(engines) -> None:
    watched = Watched(engines["on"])
    want = _run(engines["off"])
    got = _run(engines["on"])
    assert got == want
    ahead = [r for step in watched.ahead for r in step]
    # The plain ones ran ahead; those whose next step needs their token on the host did not,
    # min_tokens only once its 6 tokens were in.
    for name in ("greedy", "eos", "seeded", "logprobs", "pair#0", "pair#1", "stop"):
        assert name in ahead, name
    assert "penalised" not in ahead
    assert 0 < ahead.count("min") <= 12 - 6
    assert ahead.count("greedy") >= 20
    assert want[("eos", 0)][2] in ("stop", "length")


def test_an_abort_while_a_step_runs_ahead(engines) -> None:
    want = _run(engines["off"], abort_after=5)
    got = _run(engines["on"], abort_after=5)
    assert want.pop(("greedy", 0))[2] is None and got.pop(("greedy", 0))[2] is None
    assert got == want
