"""Scheduler, driven by a fake model that reads its context back from simulated paged KV memory.

The `make_engine` fixture (conftest.py) checks after every step that block ownership matches
reference counts and that each running request holds exactly the blocks its progress needs,
and at teardown that the pool is all-free again.
"""

from __future__ import annotations

import random

import pytest

from tandem.batch.scheduler_output import ModelRunnerOutput
from tandem.types import RequestStatus, SampledToken

EOS = 2


def prompt(n: int, seed: int = 0) -> list[int]:
    """n prompt tokens in [10, 90); different seeds give different first blocks."""
    rng = random.Random(seed)
    return [10 + seed % 80] + [rng.randrange(10, 90) for _ in range(n - 1)]


# --- basics ---------------------------------------------------------------------------


def test_nothing_to_do(make_engine) -> None:
    eng = make_engine()
    out = eng.scheduler.schedule()
    assert out.empty and out.total_num_scheduled_tokens == 0
    assert out.preempted_request_ids == [] and out.finished_request_ids == []
    assert out.new_requests == [] and out.cached_requests == []
    assert not eng.scheduler.has_unfinished()
    assert eng.scheduler.update_from_output(out, ModelRunnerOutput()) == []


def test_single_request_runs_to_max_tokens(make_engine, reference) -> None:
    eng = make_engine()
    p = prompt(10)
    req = eng.add("a", p, max_tokens=5)
    assert eng.scheduler.num_unfinished == 1 and eng.scheduler.has_unfinished()
    assert eng.run() == 5  # one prefill step, then one decode per step
    assert req.output_token_ids == reference(p, 5)
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert eng.finished["a"].reason == RequestStatus.FINISHED_LENGTH
    assert req.num_cached_tokens == 0
    assert eng.scheduler.num_unfinished == 0
    assert eng.summaries[0] == [("a", 0, 10, True)]
    assert eng.summaries[1] == [("a", 10, 1, True)]


def test_output_is_plain_data_that_only_says_what_changed(make_engine) -> None:
    """A request's tokens cross to the runner once; after that, the new token and blocks only."""
    import pickle

    eng = make_engine(max_num_batched_tokens=64)
    eng.add("a", prompt(10), max_tokens=6)
    first = eng.step()
    assert [n.request_id for n in first.new_requests] == ["a"] and first.cached_requests == []
    assert first.new_requests[0].prompt_token_ids == prompt(10) and first.num_scheduled_tokens == {"a": 10}
    sizes = []
    for _ in range(4):
        out = eng.step()
        assert out.new_requests == [] and [c.request_id for c in out.cached_requests] == ["a"]
        cached = out.cached_requests[0]
        assert len(cached.new_token_ids) == 1 and out.num_scheduled_tokens == {"a": 1}
        sizes.append(len(pickle.dumps(out)))
    assert max(sizes) - min(sizes) <= 8, sizes  # independent of the sequence's length
    eng.run()


def test_add_request_refuses_a_duplicate_id(make_engine) -> None:
    """Prompts are validated at the edge (server, LLM); the scheduler checks only its own state."""
    eng = make_engine(max_model_len=16, num_blocks=4)
    eng.add("a", prompt(15), max_tokens=1)
    with pytest.raises(ValueError, match="already in use"):
        eng.add("a", prompt(3))
    assert list(eng.scheduler.requests) == ["a"]
    eng.run()


# --- token budget and chunked prefill ---------------------------------------------------


def test_chunked_prefill_of_a_long_prompt(make_engine, reference) -> None:
    eng = make_engine(max_num_batched_tokens=16)
    p = prompt(40)
    req = eng.add("a", p, max_tokens=2)
    eng.step()
    assert eng.summaries[-1] == [("a", 0, 16, False)]
    assert req.output_token_ids == [] and req.num_computed_tokens == 16
    eng.step()
    assert eng.summaries[-1] == [("a", 16, 16, False)]
    assert req.output_token_ids == []
    eng.step()
    assert eng.summaries[-1] == [("a", 32, 8, True)]
    assert req.output_token_ids == reference(p, 1)
    eng.step()
    assert eng.summaries[-1] == [("a", 40, 1, True)]
    assert req.output_token_ids == reference(p, 2)
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_token_budget_is_respected_and_filled(make_engine, reference) -> None:
    """Never more than the budget; never less while there is at least a budget's work."""
    budget = 16
    eng = make_engine(max_num_batched_tokens=budget, num_blocks=64)
    prompts = {f"r{i}": prompt(13 + 5 * i, seed=i) for i in range(5)}
    for request_id, p in prompts.items():
        eng.add(request_id, p, max_tokens=4)
    while eng.scheduler.has_unfinished():
        pending = sum(r.num_tokens - r.num_computed_tokens for r in eng.scheduler.requests.values())
        out = eng.step()
        assert out.total_num_scheduled_tokens == min(budget, pending)
    for request_id, p in prompts.items():
        assert eng.finished[request_id].request.output_token_ids == reference(p, 4)


def test_decodes_go_before_new_prefills(make_engine, reference) -> None:
    eng = make_engine(max_num_batched_tokens=16)
    a = eng.add("a", prompt(4, 1), max_tokens=8)
    eng.step()
    b = eng.add("b", prompt(40, 2), max_tokens=2)
    eng.step()
    assert eng.summaries[-1] == [("a", 4, 1, True), ("b", 0, 15, False)]
    # While b's prefill runs in chunks, a still decodes every step, first in the batch.
    eng.step()
    eng.step()
    assert eng.summaries[-2] == [("a", 5, 1, True), ("b", 15, 15, False)]
    assert eng.summaries[-1] == [("a", 6, 1, True), ("b", 30, 10, True)]
    eng.run()
    assert a.output_token_ids == reference(prompt(4, 1), 8)
    assert b.output_token_ids == reference(prompt(40, 2), 2)


def test_running_requests_keep_arrival_order(make_engine) -> None:
    eng = make_engine(max_num_batched_tokens=64)
    for i in range(4):
        eng.add(f"r{i}", prompt(5, i), max_tokens=3)
    eng.step()
    eng.step()
    assert [c[0] for c in eng.chunks(eng.outputs[-1])] == ["r0", "r1", "r2", "r3"]
    eng.run()


def test_max_num_seqs(make_engine, reference) -> None:
    eng = make_engine(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(5):
        eng.add(f"r{i}", prompt(4, i), max_tokens=3 + i)
    first_step: dict[str, int] = {}
    step = 0
    while eng.scheduler.has_unfinished():
        out = eng.step()
        assert len(out.num_scheduled_tokens) <= 2
        for request_id in out.num_scheduled_tokens:
            first_step.setdefault(request_id, step)
        step += 1
    # FCFS: admitted in arrival order, each as soon as a slot frees up.
    assert list(first_step) == ["r0", "r1", "r2", "r3", "r4"]
    assert first_step == {"r0": 0, "r1": 0, "r2": 3, "r3": 4, "r4": 8}
    for i in range(5):
        assert eng.finished[f"r{i}"].request.output_token_ids == reference(prompt(4, i), 3 + i)


def test_fcfs_head_of_line_is_not_overtaken(make_engine, reference) -> None:
    """A request that does not fit yet blocks later ones, even ones that would fit."""
    eng = make_engine(num_blocks=8, max_num_batched_tokens=64, max_model_len=32)
    a = eng.add("a", prompt(12, 1), max_tokens=10)  # 3 blocks, growing to 6
    b = eng.add("b", prompt(24, 2), max_tokens=1)  # needs 6 blocks at once
    c = eng.add("c", prompt(4, 3), max_tokens=2)  # would fit in 1 block
    first_step: dict[str, int] = {}
    step = 0
    while eng.scheduler.has_unfinished():
        out = eng.step()
        for request_id in out.num_scheduled_tokens:
            first_step.setdefault(request_id, step)
        step += 1
    assert first_step["a"] == 0
    assert first_step["b"] == first_step["c"] == 10  # both right after a finished
    assert eng.scheduler.num_preemptions == 0
    assert a.output_token_ids == reference(prompt(12, 1), 10)
    assert b.output_token_ids == reference(prompt(24, 2), 1)
    assert c.output_token_ids == reference(prompt(4, 3), 2)


# --- abort and finish -------------------------------------------------------------------


def test_abort_waiting_request(make_engine, reference) -> None:
    eng = make_engine(max_num_seqs=1)
    a = eng.add("a", prompt(6, 1), max_tokens=3)
    b = eng.add("b", prompt(6, 2), max_tokens=3)
    eng.step()
    assert b.status == RequestStatus.WAITING
    assert eng.scheduler.abort(["b"]) == [b]
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert b not in eng.scheduler.waiting and "b" not in eng.scheduler.requests
    assert eng.step().finished_request_ids == ["b"]
    eng.run()
    assert a.output_token_ids == reference(prompt(6, 1), 3)
    assert b.output_token_ids == []


def test_abort_running_request_frees_its_blocks(make_engine) -> None:
    eng = make_engine(max_num_batched_tokens=16)
    a = eng.add("a", prompt(40), max_tokens=3)
    eng.step()
    assert eng.pool.num_used_blocks == 4
    assert eng.scheduler.abort(["a", "unknown"]) == [a]
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    assert eng.scheduler.running == [] and not eng.scheduler.has_unfinished()
    assert eng.scheduler.abort(["a"]) == []  # already gone
    out = eng.step()
    assert out.empty and out.finished_request_ids == ["a"]


def test_abort_while_the_step_runs(make_engine) -> None:
    """The model's result for a request aborted mid-step is dropped."""
    eng = make_engine()
    a = eng.add("a", prompt(6), max_tokens=3)
    b = eng.add("b", prompt(6, 1), max_tokens=3)
    out = eng.scheduler.schedule()
    eng.scheduler.abort(["a"])
    sampled = {"a": [SampledToken(500)], "b": [SampledToken(501)]}
    updates = eng.scheduler.update_from_output(out, ModelRunnerOutput(sampled))
    assert [(u.request, u.finished) for u in updates] == [(b, None)]
    assert a.output_token_ids == [] and a.num_computed_tokens == 0
    assert b.output_token_ids == [501]
    eng.check_state()
    eng.scheduler.abort(["b"])


def test_finish_for_an_outside_reason(make_engine) -> None:
    """A stop string is found in the detokenized text: the engine finishes the request."""
    eng = make_engine()
    a = eng.add("a", prompt(6), max_tokens=10)
    eng.step()
    eng.scheduler.finish("a", RequestStatus.FINISHED_STOPPED)
    eng.scheduler.finish("a", RequestStatus.FINISHED_STOPPED)  # idempotent
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    assert eng.step().finished_request_ids == ["a"]
    assert eng.step().finished_request_ids == []


def test_finished_ids_are_reported_once(make_engine) -> None:
    eng = make_engine()
    eng.add("a", prompt(4), max_tokens=1)
    eng.add("b", prompt(4, 1), max_tokens=2)
    assert eng.step().finished_request_ids == []
    assert "a" in eng.finished
    assert eng.step().finished_request_ids == ["a"]
    assert eng.scheduler.schedule().finished_request_ids == ["b"]
    assert eng.scheduler.schedule().finished_request_ids == []


# --- preemption -------------------------------------------------------------------------


def run_workload(eng, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    for request_id, p in prompts.items():
        eng.add(request_id, p, max_tokens=max_tokens)
    eng.run()
    return {rid: eng.finished[rid].request.output_token_ids for rid in prompts}


@pytest.mark.parametrize("enable_caching", [True, False])
def test_preemption_recomputes_and_gives_the_same_tokens(
    make_engine, reference, enable_caching: bool
) -> None:
    prompts = {f"r{i}": prompt(6, i) for i in range(4)}
    big = make_engine(num_blocks=64, max_num_batched_tokens=64, enable_caching=enable_caching)
    expected = run_workload(big, prompts, max_tokens=14)
    assert big.scheduler.num_preemptions == 0
    assert expected == {rid: reference(p, 14) for rid, p in prompts.items()}

    # 4 requests of up to 20 tokens (5 blocks) each do not fit in 10 blocks together.
    tiny = make_engine(
        num_blocks=10, max_num_batched_tokens=64, max_model_len=40, enable_caching=enable_caching
    )
    assert run_workload(tiny, prompts, max_tokens=14) == expected
    assert tiny.scheduler.num_preemptions > 0
    preempted = [rid for out in tiny.outputs for rid in out.preempted_request_ids]
    assert len(preempted) == tiny.scheduler.num_preemptions
    assert sum(tiny.finished[rid].request.num_preemptions for rid in prompts) == len(preempted)
    for rid in prompts:
        assert tiny.finished[rid].request.num_cached_tokens == 0


def test_preemption_takes_the_newest_request_and_admits_nothing(make_engine) -> None:
    eng = make_engine(num_blocks=6, max_num_batched_tokens=64, max_model_len=24)
    for i in range(3):
        eng.add(f"r{i}", prompt(7, i), max_tokens=16)
    while eng.scheduler.has_unfinished():
        running_before = [r.request_id for r in eng.scheduler.running]
        waiting_before = [r.request_id for r in eng.scheduler.waiting]
        out = eng.step()
        if not out.preempted_request_ids:
            continue
        # Victims are taken from the newest end of the running list.
        k = len(out.preempted_request_ids)
        assert out.preempted_request_ids == running_before[::-1][:k]
        # No admissions in a step that preempted; victims wait at the front, oldest first.
        assert set(out.num_scheduled_tokens) <= set(running_before)
        waiting_now = [r.request_id for r in eng.scheduler.waiting]
        assert waiting_now == running_before[len(running_before) - k :] + waiting_before
        for rid in out.preempted_request_ids:
            req = eng.scheduler.requests[rid]
            assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
    assert eng.scheduler.num_preemptions > 0


def test_preempted_request_is_recomputed_with_its_outputs(make_engine, reference) -> None:
    eng = make_engine(num_blocks=6, max_num_batched_tokens=64, max_model_len=24)
    prompts = {f"r{i}": prompt(7, i) for i in range(3)}
    for rid, p in prompts.items():
        eng.add(rid, p, max_tokens=16)
    resumed = []
    while eng.scheduler.has_unfinished():
        out = eng.step()
        for rid, start, num_tokens in eng.chunks(out):
            req = eng.scheduler.requests.get(rid) or eng.finished[rid].request
            if req.num_preemptions and num_tokens > 1:
                resumed.append((rid, start, num_tokens))
    assert resumed
    for rid, start, num_tokens in resumed:
        # Recomputation covers prompt and generated tokens and samples at the end.
        assert start % 4 == 0
        assert start + num_tokens > len(prompts[rid])
    for rid, p in prompts.items():
        assert eng.finished[rid].request.output_token_ids == reference(p, 16)


def test_abort_a_preempted_request(make_engine) -> None:
    eng = make_engine(num_blocks=6, max_num_batched_tokens=64, max_model_len=24)
    for i in range(3):
        eng.add(f"r{i}", prompt(7, i), max_tokens=16)
    while not any(r.status == RequestStatus.PREEMPTED for r in eng.scheduler.waiting):
        eng.step()
    victim = next(r for r in eng.scheduler.waiting if r.status == RequestStatus.PREEMPTED)
    assert eng.scheduler.abort([victim.request_id]) == [victim]
    assert victim not in eng.scheduler.waiting
    eng.run()


# --- stopping ---------------------------------------------------------------------------


def scripted(make_engine, tokens: list[int], **params):
    eng = make_engine(max_model_len=params.pop("max_model_len", 256), script={"a": tokens})
    req = eng.add("a", params.pop("prompt", prompt(5)), **params)
    eng.run()
    return req


def test_stop_on_eos(make_engine) -> None:
    req = scripted(make_engine, [500, 501, EOS, 503])
    assert req.output_token_ids == [500, 501, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.stop_reason is None


def test_ignore_eos(make_engine) -> None:
    req = scripted(make_engine, [500, EOS, EOS, 503], ignore_eos=True, max_tokens=4)
    assert req.output_token_ids == [500, EOS, EOS, 503]
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_eos_only_stops_requests_that_have_it(make_engine) -> None:
    eng = make_engine(script={"a": [500, EOS, 502]})
    req = eng.add("a", prompt(5), eos=frozenset(), max_tokens=3)
    eng.run()
    assert req.output_token_ids == [500, EOS, 502]
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_stop_token_ids(make_engine) -> None:
    req = scripted(make_engine, [500, 77, 502], stop_token_ids=[77, 78])
    assert req.output_token_ids == [500, 77]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.stop_reason == 77


def test_stop_token_ids_apply_with_ignore_eos(make_engine) -> None:
    req = scripted(make_engine, [EOS, 77, 502], stop_token_ids=[77], ignore_eos=True)
    assert req.output_token_ids == [EOS, 77]
    assert req.stop_reason == 77


def test_max_tokens(make_engine) -> None:
    req = scripted(make_engine, list(range(500, 510)), max_tokens=3)
    assert req.output_token_ids == [500, 501, 502]
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_max_tokens_one(make_engine) -> None:
    """A prefill-only request (the PD prefill hop) finishes on its first token."""
    req = scripted(make_engine, [500, 501], max_tokens=1)
    assert req.output_token_ids == [500]
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_max_model_len(make_engine) -> None:
    req = scripted(
        make_engine, list(range(500, 520)), prompt=prompt(10), max_model_len=14, max_tokens=None
    )
    assert req.output_token_ids == [500, 501, 502, 503]
    assert req.num_tokens == 14
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_min_tokens_suppresses_early_stops(make_engine) -> None:
    req = scripted(make_engine, [EOS, 77, EOS, 503], min_tokens=3, stop_token_ids=[77])
    assert req.output_token_ids == [EOS, 77, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.stop_reason is None


def test_min_tokens_then_stop_token(make_engine) -> None:
    req = scripted(make_engine, [77, 501, 77, 503], min_tokens=2, stop_token_ids=[77])
    assert req.output_token_ids == [77, 501, 77]
    assert req.stop_reason == 77


def test_max_tokens_wins_over_a_later_eos(make_engine) -> None:
    req = scripted(make_engine, [500, 501, EOS], max_tokens=2)
    assert req.output_token_ids == [500, 501]
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_eos_on_the_last_allowed_token_is_a_stop(make_engine) -> None:
    req = scripted(make_engine, [500, EOS], max_tokens=2)
    assert req.status == RequestStatus.FINISHED_STOPPED


# --- prefix caching through the scheduler ---------------------------------------------


def test_prefix_hit_sets_num_cached_tokens(make_engine, reference) -> None:
    eng = make_engine()
    p = prompt(14)
    a = eng.add("a", p, max_tokens=3)
    eng.run()
    b = eng.add("b", p, max_tokens=3)
    c = eng.add("c", p[:12], max_tokens=3)
    d = eng.add("d", prompt(14, 5), max_tokens=3)
    eng.step()
    assert eng.summaries[-1] == [
        ("b", 12, 2, True),
        ("c", 8, 4, True),
        ("d", 0, 14, True),
    ]
    eng.run()
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 12)
    assert (c.num_cached_tokens, d.num_cached_tokens) == (8, 0)
    # The fake model read the shared blocks back: same context, same tokens.
    assert b.output_token_ids == a.output_token_ids == reference(p, 3)
    assert c.output_token_ids == reference(p[:12], 3)
    stats = eng.kv.stats
    assert (stats.queries, stats.hits) == (14 * 3 + 12, 12 + 8)


def test_prefix_shared_with_a_running_request(make_engine, reference) -> None:
    eng = make_engine(max_num_batched_tokens=64)
    system = prompt(20, 7)
    a = eng.add("a", system + [11, 12, 13], max_tokens=6)
    eng.step()
    b = eng.add("b", system + [14, 15], max_tokens=6)
    eng.step()
    assert b.num_cached_tokens == 20
    shared = eng.kv.blocks_of("a")[:5]
    assert eng.kv.blocks_of("b")[:5] == shared
    assert all(blk.ref_count == 2 for blk in shared)
    eng.run()
    assert a.output_token_ids == reference(system + [11, 12, 13], 6)
    assert b.output_token_ids == reference(system + [14, 15], 6)


def test_multi_turn_follow_up_reuses_the_answer(make_engine, reference) -> None:
    eng = make_engine()
    a = eng.add("a", prompt(9), max_tokens=8)
    eng.run()
    # 17 tokens, the last never computed: 16 computed, all 4 blocks published.
    follow_up = a.all_token_ids + [40, 41, 42]
    b = eng.add("b", follow_up, max_tokens=2)
    eng.run()
    assert b.num_cached_tokens == 16
    assert b.output_token_ids == reference(follow_up, 2)


def test_prefix_caching_disabled(make_engine) -> None:
    eng = make_engine(enable_caching=False)
    p = prompt(14)
    eng.add("a", p, max_tokens=2)
    eng.run()
    b = eng.add("b", p, max_tokens=2)
    eng.run()
    assert b.num_cached_tokens == 0
    assert eng.pool.num_cached_blocks == 0


# --- a mixed workload -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_blocks", "budget", "max_num_seqs", "enable_caching"),
    [
        (128, 64, 16, True),
        (16, 24, 16, True),
        (16, 7, 3, True),
        (16, 24, 16, False),
    ],
)
def test_mixed_workload_matches_reference(
    make_engine, reference, num_blocks: int, budget: int, max_num_seqs: int, enable_caching: bool
) -> None:
    """Shared system prompts, multi-turn tails, staggered arrivals, tight pools: same tokens."""
    rng = random.Random(1234)
    eng = make_engine(
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=64,
        enable_caching=enable_caching,
    )
    systems = [prompt(rng.randrange(4, 24), seed) for seed in range(3)]
    jobs = []
    for i in range(24):
        p = rng.choice(systems) + [rng.randrange(10, 90) for _ in range(rng.randrange(1, 12))]
        jobs.append((rng.randrange(0, 30), f"r{i}", p, rng.randrange(1, 64 - len(p))))
    jobs.sort()
    steps = 0
    while jobs or eng.scheduler.has_unfinished():
        while jobs and jobs[0][0] <= steps:
            _, rid, p, max_tokens = jobs.pop(0)
            eng.add(rid, p, max_tokens=max_tokens)
        eng.step()
        steps += 1
        assert steps < 2000
    assert len(eng.finished) == 24
    for done in eng.finished.values():
        req = done.request
        assert req.output_token_ids == reference(req.prompt_token_ids, len(req.output_token_ids))
        assert req.num_output_tokens == req.sampling_params.max_tokens
    if enable_caching and num_blocks == 128:
        assert eng.kv.stats.hits > 0
        assert any(d.request.num_cached_tokens > 0 for d in eng.finished.values())


def test_prefix_stats_count_each_request_once(make_engine) -> None:
    """A request that waits for room, or is preempted and recomputed, is one query, not many."""
    eng = make_engine(num_blocks=8, max_num_batched_tokens=64, max_model_len=32)
    p = prompt(12, 1)
    eng.add("a", p, max_tokens=10)  # grows to 6 blocks
    eng.add("b", prompt(24, 2), max_tokens=1)  # waits ~10 steps for 6 free blocks
    eng.run()
    assert eng.kv.stats.queries == 12 + 24
    assert eng.kv.stats.hits == 0

    tiny = make_engine(num_blocks=10, max_num_batched_tokens=64, max_model_len=40)
    prompts = {f"r{i}": prompt(6, i) for i in range(4)}
    run_workload(tiny, prompts, max_tokens=14)
    assert tiny.scheduler.num_preemptions > 0
    assert tiny.kv.stats.queries == 4 * 6
    assert tiny.kv.stats.hits == 0
