"""Asynchronous scheduling over the fake model: step N+1 scheduled before step N's tokens land.

The driver keeps two steps in flight, as the engine core does when the executor runs ahead: it
schedules and submits a step, then collects the oldest. `RunAheadModel` is the fake runner with
the one thing asynchronous scheduling adds: a request named in `last_step_inputs` takes as its
input the token the model sampled for it in the step before, which the scheduler has not seen
yet. The model reads every sampled context back from its simulated KV memory and checks it
against every token it has sampled, so an input taken from the wrong step, a position computed
twice or a block freed while a step still writes it changes the output or fails an assertion.
"""

from __future__ import annotations

import random
from collections import deque

from tandem.batch.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tandem.types import SampledToken
from tests.engine.conftest import EOS, Chunk, FakeModel, next_token


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [10 + seed % 80] + [rng.randrange(10, 90) for _ in range(n - 1)]


class RunAheadModel(FakeModel):
    """The fake runner, taking a run-ahead request's input from its own last samples."""

    def __init__(self, pool, block_size, script=None) -> None:
        super().__init__(pool, block_size, script)
        self.truth: dict[str, list[int]] = {}  # every token of each request, as the device knows them
        self.last_samples: dict[str, int] = {}
        self.ahead_rows = 0

    def update_states(self, out: SchedulerOutput) -> None:
        super().update_states(out)
        for new in out.new_requests:
            self.truth[new.request_id] = list(new.prompt_token_ids) + list(new.output_token_ids)

    def chunks(self, out: SchedulerOutput) -> list[Chunk]:
        chunks = []
        for request_id, count in out.num_scheduled_tokens.items():
            state = self.requests[request_id]
            start = state.num_computed
            if request_id in out.last_step_inputs:
                assert count == 1 and request_id in self.last_samples, "run ahead of a step that did not sample it"
                assert start == len(self.truth[request_id]) - 1, "run ahead from a stale sample"
                chunks.append(Chunk(request_id, start, 1, True, state.block_ids, [self.last_samples[request_id]]))
                self.ahead_rows += 1
                continue
            tokens = state.tokens
            assert tokens == self.truth[request_id][: len(tokens)]
            chunks.append(Chunk(request_id, start, count, start + count == len(tokens), state.block_ids,
                                tokens[start : start + count]))
        return chunks

    def execute(self, out: SchedulerOutput, oracle=None) -> ModelRunnerOutput:
        self.update_states(out)
        size = self.block_size
        chunks = self.last_chunks = self.chunks(out)
        for chunk in chunks:
            self.write(chunk.block_ids, chunk.start, chunk.token_ids)
        result = ModelRunnerOutput()
        samples = {}
        for chunk in chunks:
            if not chunk.samples:
                continue
            end = chunk.start + chunk.num_tokens
            stored = [self.memory[chunk.block_ids[p // size]][p % size] for p in range(end)]
            truth = self.truth[chunk.request_id]
            assert stored == truth[:end] and end == len(truth), "KV memory does not hold the context"
            script = self.script.get(chunk.request_id)
            prompt_len = len(self.requests[chunk.request_id].prompt)
            token = next_token(stored) if script is None else script[end - prompt_len]
            truth.append(token)
            samples[chunk.request_id] = token
            result.sampled[chunk.request_id] = [SampledToken(token)]
        self.last_samples = samples
        return result


class TwoInFlight:
    """Drives an engine as the core does with a run-ahead executor: two steps in flight."""

    def __init__(self, eng) -> None:
        self.eng = eng
        eng.model = RunAheadModel(eng.pool, eng.kv.block_size, eng.model.script)
        self.in_flight: deque = deque()
        self.steps: list[SchedulerOutput] = []

    def step(self) -> None:
        eng = self.eng
        out = eng.scheduler.schedule()
        self.check(out)
        if not out.empty or out.finished_request_ids:
            self.in_flight.append((out, eng.model.execute(out)))
            self.steps.append(out)
            if not out.empty and len(self.in_flight) < 2:
                return
        if self.in_flight:
            done, result = self.in_flight.popleft()
            for update in eng.scheduler.update_from_output(done, result):
                if update.finished is not None:
                    eng.finished[update.request.request_id] = update.finished
        for request in eng.scheduler.running:
            pending = eng.scheduler._in_flight.get(request.request_id, 0)
            held = eng.kv.num_blocks_of(request.request_id)
            assert held == -(-(request.num_computed_tokens + pending) // eng.kv.block_size)

    def check(self, out: SchedulerOutput) -> None:
        scheduler = self.eng.scheduler
        for request_id in out.last_step_inputs:
            assert out.num_scheduled_tokens[request_id] == 1
            assert scheduler._in_flight[request_id] >= 1
        assert not set(out.preempted_request_ids) & {r for o, _ in self.in_flight for r in o.num_scheduled_tokens}

    def run(self, max_steps: int = 2000) -> None:
        steps = 0
        while self.eng.scheduler.has_unfinished() or self.in_flight:
            self.step()
            steps += 1
            assert steps < max_steps, "no progress"


def test_decodes_run_ahead_of_their_tokens_and_give_the_reference_output(make_engine, reference) -> None:
    eng = make_engine(max_num_batched_tokens=64, run_ahead=True)
    prompts = {f"r{i}": prompt(5 + 3 * i, i) for i in range(5)}
    for request_id, tokens in prompts.items():
        eng.add(request_id, tokens, max_tokens=6 + i if (i := int(request_id[1:])) else 1)
    driver = TwoInFlight(eng)
    driver.run()
    for request_id, tokens in prompts.items():
        wanted = 1 if request_id == "r0" else 6 + int(request_id[1:])
        assert eng.finished[request_id].request.output_token_ids == reference(tokens, wanted)
    # Every decode after the first ran ahead: each request's samples but its first and last
    # came from the device (max_tokens stops the last one being scheduled ahead).
    assert eng.model.ahead_rows == sum(6 + i - 1 for i in range(1, 5))
    assert sum(bool(o.last_step_inputs) for o in driver.steps) >= 9


def test_without_run_ahead_a_request_waits_for_its_token(make_engine) -> None:
    eng = make_engine(max_num_batched_tokens=64, run_ahead=False)
    eng.add("only", prompt(6, 1), max_tokens=5)
    first = eng.scheduler.schedule()
    eng.model.execute(first)
    assert eng.scheduler.schedule().empty
    eng.scheduler.abort(["only"])


def test_an_end_of_sequence_in_flight_drops_the_step_ahead(make_engine) -> None:
    """The step that samples EOS is in flight when the next is scheduled: that next step runs
    the request once more, and its token never reaches the output; the blocks come back."""
    script = {"s": [501, 502, EOS, 503, 504, 505]}
    eng = make_engine(max_num_batched_tokens=64, run_ahead=True, script=script)
    eng.add("s", prompt(7, 2), max_tokens=10)
    eng.add("t", prompt(9, 3), max_tokens=8)
    driver = TwoInFlight(eng)
    driver.run()
    assert eng.finished["s"].request.output_token_ids == [501, 502, EOS]
    wasted = [o for o in driver.steps if "s" in o.last_step_inputs]
    assert len(wasted) == 3  # after 501, 502 and EOS: the last one's row is dropped
    assert len(eng.finished["t"].request.output_token_ids) == 8


def test_requests_that_need_their_token_on_the_host_wait_for_it(make_engine, reference) -> None:
    """Penalties over the output and a min_tokens still pending are applied on the host from
    the tokens it was sent: those requests never run ahead; the others do, in the same steps."""
    eng = make_engine(max_num_batched_tokens=64, run_ahead=True)
    eng.add("penalised", prompt(6, 4), max_tokens=6, repetition_penalty=1.2)
    eng.add("min", prompt(6, 5), max_tokens=8, min_tokens=4)
    eng.add("plain", prompt(6, 6), max_tokens=6)
    driver = TwoInFlight(eng)
    driver.run()
    ahead = [r for o in driver.steps for r in o.last_step_inputs]
    assert "penalised" not in ahead and "plain" in ahead
    # min_tokens 4: from the host's fourth token on it runs ahead, not before.
    assert 0 < ahead.count("min") <= 8 - 4
    for request_id, seed, count in (("penalised", 4, 6), ("min", 5, 8), ("plain", 6, 6)):
        assert eng.finished[request_id].request.output_token_ids == reference(prompt(6, seed), count)


def test_long_prompts_and_preemption_under_run_ahead(make_engine, reference) -> None:
    """Chunked prompts, requests arriving while others decode, and a pool small enough to
    preempt: preemption takes only requests with nothing in flight, and the output is the
    reference."""
    eng = make_engine(num_blocks=16, max_num_batched_tokens=16, run_ahead=True)
    prompts = {f"r{i}": prompt(9 + 7 * (i % 3), 30 + i) for i in range(6)}
    driver = TwoInFlight(eng)
    for i, (request_id, tokens) in enumerate(prompts.items()):
        eng.add(request_id, tokens, max_tokens=10)
        for _ in range(i):
            driver.step()
    driver.run()
    assert eng.scheduler.num_preemptions > 0
    for request_id, tokens in prompts.items():
        assert eng.finished[request_id].request.output_token_ids == reference(tokens, 10)
    assert eng.model.ahead_rows > 20


def test_an_abort_with_a_step_ahead_in_flight(make_engine, reference) -> None:
    eng = make_engine(max_num_batched_tokens=64, run_ahead=True)
    eng.add("a", prompt(10, 7), max_tokens=20)
    eng.add("b", prompt(10, 8), max_tokens=5)
    driver = TwoInFlight(eng)
    for _ in range(4):
        driver.step()
    assert any("a" in o.last_step_inputs for o, _ in driver.in_flight)
    eng.scheduler.abort(["a"])
    assert "a" not in eng.scheduler._sampling_in_flight
    driver.run()
    assert eng.finished["b"].request.output_token_ids == reference(prompt(10, 8), 5)


def test_the_context_limit_stops_running_ahead(make_engine, reference) -> None:
    eng = make_engine(max_num_batched_tokens=64, run_ahead=True, max_model_len=16)
    tokens = prompt(10, 9)
    eng.add("edge", tokens, max_tokens=100)
    driver = TwoInFlight(eng)
    driver.run()
    assert eng.finished["edge"].request.output_token_ids == reference(tokens, 6)
    assert eng.model.ahead_rows == 5  # tokens 2-6: none past the last the context holds
