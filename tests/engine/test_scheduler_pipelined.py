"""The scheduler with micro-batches in flight (pipeline parallelism), over the fake model.

A pipelined engine submits a step before the previous one's result is in: the fake model
runs each step as it is submitted (as stage 0 does, in order), and the result reaches the
scheduler one step later. The fake model reads every sampled context back from its simulated
KV memory, so a chunk scheduled over KV not yet written, a block reused while a step still
writes it, or a token taken twice changes the output and fails the test.
"""

from __future__ import annotations

import random
from collections import deque

from tandem.batch.scheduler_output import SchedulerOutput
from tandem.types import RequestStatus

DEPTH = 2


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [10 + seed % 80] + [rng.randrange(10, 90) for _ in range(n - 1)]


class Pipelined:
    """Drives an `Engine` (conftest) with up to DEPTH steps in flight."""

    def __init__(self, eng) -> None:
        self.eng = eng
        self.in_flight: deque = deque()
        self.batches: list[list[str]] = []
        self.chunks: list[list[tuple[str, int, int]]] = []

    def check(self, out: SchedulerOutput) -> None:
        scheduler = self.eng.scheduler
        flying = {rid for o, _ in self.in_flight for rid in o.num_scheduled_tokens}
        for request_id, start, count in self.eng.chunks(out):
            request = scheduler.requests[request_id]
            if request_id in flying:  # only a prompt's next chunk may follow one in flight
                assert start > request.num_computed_tokens, "a request scheduled twice at one position"
            assert start + count <= request.num_tokens
        assert not set(out.preempted_request_ids) & flying, "an in-flight request was preempted"

    def check_blocks(self) -> None:
        scheduler, size = self.eng.scheduler, self.eng.kv.block_size
        for request in scheduler.running:
            pending = scheduler._in_flight.get(request.request_id, 0)
            held = self.eng.kv.num_blocks_of(request.request_id)
            assert held == -(-(request.num_computed_tokens + pending) // size)

    def step(self) -> None:
        eng = self.eng
        if len(self.in_flight) < DEPTH:
            out = eng.scheduler.schedule()
            self.check(out)
            if not out.empty or out.finished_request_ids:
                result = eng.model.execute(out)  # stage 0 runs it now; its result lands later
                self.in_flight.append((out, result))
                self.batches.append(list(out.num_scheduled_tokens))
                self.chunks.append(eng.chunks(out))
                if not out.empty and len(self.in_flight) < DEPTH:
                    return
        if self.in_flight:
            out, result = self.in_flight.popleft()
            for update in eng.scheduler.update_from_output(out, result):
                if update.finished is not None:
                    eng.finished[update.request.request_id] = update.finished
        self.check_blocks()

    def run(self, max_steps: int = 2000) -> None:
        steps = 0
        while self.eng.scheduler.has_unfinished() or self.in_flight:
            self.step()
            steps += 1
            assert steps < max_steps, "no progress"


def test_micro_batches_split_the_running_requests_and_give_the_reference_output(make_engine, reference) -> None:
    eng = make_engine(max_num_batched_tokens=64, max_concurrent_batches=DEPTH)
    prompts = {f"r{i}": prompt(6 + i, i) for i in range(6)}
    for request_id, tokens in prompts.items():
        eng.add(request_id, tokens, max_tokens=10)
    driver = Pipelined(eng)
    driver.run()
    for request_id, tokens in prompts.items():
        assert eng.finished[request_id].request.output_token_ids == reference(tokens, 10)
    decoding = [b for b in driver.batches if b][3:-3]
    assert decoding and all(len(b) == 3 for b in decoding)  # half of the 6 running requests each


def test_a_long_prompt_streams_its_chunks_through_the_pipeline(make_engine, reference) -> None:
    """A prompt of 5 chunks: each chunk is scheduled while the one before is still in flight."""
    eng = make_engine(max_num_batched_tokens=8, max_concurrent_batches=DEPTH)
    tokens = prompt(40, 3)
    eng.add("long", tokens, max_tokens=4)
    driver = Pipelined(eng)
    driver.step()
    driver.step()  # the second chunk goes out before the first is collected
    assert driver.batches[:2] == [["long"], ["long"]]
    assert driver.chunks[:2] == [[("long", 0, 8)], [("long", 8, 8)]]
    driver.run()
    assert eng.finished["long"].request.output_token_ids == reference(tokens, 4)


def test_a_request_waits_for_its_token_before_it_is_scheduled_again(make_engine) -> None:
    eng = make_engine(max_num_batched_tokens=64, max_concurrent_batches=DEPTH)
    eng.add("only", prompt(6, 1), max_tokens=5)
    first = eng.scheduler.schedule()
    eng.model.execute(first)
    second = eng.scheduler.schedule()
    assert second.empty  # its prefill samples: the next input is the token not yet back
    eng.scheduler.abort(["only"])


def test_preemption_picks_only_requests_with_nothing_in_flight(make_engine, reference) -> None:
    """Few blocks, many requests: requests are preempted and recomputed, never while a step
    may still write their blocks, and the output is still the reference."""
    eng = make_engine(num_blocks=14, max_num_batched_tokens=32, max_concurrent_batches=DEPTH)
    prompts = {f"r{i}": prompt(9, 20 + i) for i in range(5)}
    for request_id, tokens in prompts.items():
        eng.add(request_id, tokens, max_tokens=12)
    driver = Pipelined(eng)
    driver.run()
    assert eng.scheduler.num_preemptions > 0
    for request_id, tokens in prompts.items():
        assert eng.finished[request_id].request.output_token_ids == reference(tokens, 12)


def test_an_abort_while_in_flight_frees_the_blocks_once(make_engine) -> None:
    eng = make_engine(max_num_batched_tokens=64, max_concurrent_batches=DEPTH)
    eng.add("a", prompt(10, 5), max_tokens=20)
    eng.add("b", prompt(10, 6), max_tokens=3)
    driver = Pipelined(eng)
    driver.step()
    assert driver.in_flight
    eng.scheduler.abort(["a"])
    assert eng.scheduler._in_flight.get("a") is None
    driver.run()
    assert eng.finished["b"].reason == RequestStatus.FINISHED_LENGTH


def test_prompts_arriving_together_are_shared_between_micro_batches(make_engine, reference) -> None:
    """Six 200-token prompts (1,200 tokens) under a 2,048-token budget: one step could take
    them all and leave the second stage idle; each micro-batch takes about half."""
    from tandem.engine import scheduler as scheduler_module

    eng = make_engine(num_blocks=512, max_num_batched_tokens=2048, max_concurrent_batches=DEPTH,
                      max_model_len=512)
    prompts = {f"r{i}": prompt(200, 40 + i) for i in range(6)}
    for request_id, tokens in prompts.items():
        eng.add(request_id, tokens, max_tokens=3)
    driver = Pipelined(eng)
    driver.step()
    driver.step()
    first, second = (sum(n for _, _, n in chunks) for chunks in driver.chunks[:2])
    assert (first, second) == (600, 600)
    assert scheduler_module._MIN_MICRO_BATCH < 600
    driver.run()
    for request_id, tokens in prompts.items():
        assert eng.finished[request_id].request.output_token_ids == reference(tokens, 3)
