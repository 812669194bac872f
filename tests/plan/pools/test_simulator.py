"""The cluster simulator against hand-computed timelines: one request alone, a queue, the
prefix cache across a session's turns, chunked prefill, the prefill/decode handoff."""

from __future__ import annotations

import pytest

from tandem.plan.pools.costs import CostModel, StepShape
from tandem.plan.pools.search import Slo, layouts, recommendation, search
from tandem.plan.pools.simulator import EngineLimits, Layout, simulate
from tandem.plan.pools.traffic import SimSession, SimTurn, SimWorkload, TrafficMix

COSTS = CostModel(0.03, 0.0005, 0.0003, 1e-8, 4e-8, 0.001, transfer_s_per_token=1e-5, transfer_fixed_s=0.002,
                  http_overhead_s=0.001)
HOP = COSTS.http_overhead_s


def one(prompt: int, output: int, arrival: float = 0.0, sid: str = "a") -> SimSession:
    return SimSession(sid, arrival, (SimTurn(prompt, output),))


def test_one_request_alone_colocated() -> None:
    result = simulate(SimWorkload((one(300, 5),), message_overhead=0), Layout(colocated=1), COSTS)
    (o,) = result.outcomes
    prefill = COSTS.step_s(StepShape(((300, 0),)))
    assert o.ttft_s == pytest.approx(HOP + prefill + HOP)
    decode = [COSTS.step_s(StepShape((), (300 + g - 1,))) for g in range(1, 5)]
    assert o.tpot_s == pytest.approx(sum(decode) / 4)
    assert o.cached_tokens == 0 and not o.split


def test_prefill_decode_split_hands_over_after_the_first_token() -> None:
    result = simulate(SimWorkload((one(300, 5),), message_overhead=0), Layout(prefill=1, decode=1), COSTS)
    (o,) = result.outcomes
    prefill = COSTS.step_s(StepShape(((300, 0),)))
    assert o.split and o.ttft_s == pytest.approx(HOP + prefill + HOP)
    handoff = 2 * HOP + COSTS.transfer_s(300)
    decode = sum(COSTS.step_s(StepShape((), (300 + g - 1,))) for g in range(1, 5))
    assert o.last_token_s == pytest.approx(HOP + prefill + handoff + decode + HOP)
    assert result.busy_s["prefill-0"] == pytest.approx(prefill)


def test_short_prompts_skip_the_prefill_pool() -> None:
    result = simulate(SimWorkload((one(100, 3),), message_overhead=0), Layout(prefill=1, decode=1), COSTS)
    assert not result.outcomes[0].split and result.busy_s["prefill-0"] == 0


def test_a_second_request_waits_then_batches() -> None:
    result = simulate(SimWorkload((one(1500, 3, sid="a"), one(1500, 3, sid="b")), message_overhead=0),
                      Layout(colocated=1), COSTS, EngineLimits(max_num_batched_tokens=2048))
    first, second = result.outcomes
    # the first prompt's step had started when the second arrived: the second's whole prompt
    # shares the next step with the first one's first decode
    assert second.first_token_s == pytest.approx(first.first_token_s + COSTS.step_s(
        StepShape(((1500, 0),), (1500,))))
    assert second.ttft_s > first.ttft_s


def test_a_long_prompt_is_chunked_by_the_step_budget() -> None:
    limits = EngineLimits(max_num_batched_tokens=512)
    result = simulate(SimWorkload((one(1200, 2),), message_overhead=0), Layout(colocated=1), COSTS, limits)
    steps = [StepShape(((512, 0),)), StepShape(((512, 512),)), StepShape(((176, 1024),))]
    assert result.outcomes[0].ttft_s == pytest.approx(2 * HOP + sum(COSTS.step_s(s) for s in steps))


def test_a_session_reads_its_earlier_turns_from_the_cache() -> None:
    session = SimSession("s", 0.0, (SimTurn(200, 20), SimTurn(100, 20), SimTurn(100, 20)))
    workload = SimWorkload((session,), system_tokens=1000)
    colocated = simulate(workload, Layout(colocated=2), COSTS).outcomes
    prompts = [workload.prompt_tokens(session, k) for k in range(3)]
    # system + its message's template tokens, earlier turns with their outputs, the new input
    assert prompts == [1000 + 8 + 200 + 8, 1000 + 8 + (200 + 20 + 16) + 100 + 8,
                       1000 + 8 + 2 * (20 + 16) + 200 + 100 + 100 + 8]
    assert colocated[0].cached_tokens == 0
    # the worker that decoded turn k holds its prompt and output, in whole blocks
    assert colocated[1].cached_tokens == (prompts[0] + 20) // 16 * 16
    assert colocated[2].cached_tokens == (prompts[1] + 20) // 16 * 16
    split = simulate(workload, Layout(prefill=2, decode=1), COSTS).outcomes
    # the prefill worker saw the prompts only: the outputs were decoded elsewhere
    assert split[1].cached_tokens == prompts[0] // 16 * 16


def test_the_system_prompt_is_shared_across_sessions() -> None:
    sessions = tuple(SimSession(f"s{i}", 10.0 * i, (SimTurn(50, 4),)) for i in range(3))
    outcomes = simulate(SimWorkload(sessions, system_tokens=640), Layout(colocated=1), COSTS).outcomes
    assert [o.cached_tokens for o in outcomes] == [0, 640, 640]


def test_turns_follow_each_other_and_every_request_finishes() -> None:
    workload = TrafficMix(rate=2.0, num_sessions=20, turns_min=2, turns_max=4, system_tokens=500,
                          input_min=20, input_max=80, output_min=4, output_max=12, seed=3).sample()
    for layout in layouts(3):
        result = simulate(workload, layout, COSTS)
        assert len(result.outcomes) == workload.num_requests
        by_session: dict[str, list] = {}
        for o in result.outcomes:
            by_session.setdefault(o.request.session_id, []).append(o)
        for turns in by_session.values():
            for before, after in zip(turns, turns[1:], strict=False):
                assert after.arrival_s == pytest.approx(before.last_token_s)
        assert all(0 < u <= 1 for u in result.utilisation().values() if u)


def test_layouts_and_bad_layouts() -> None:
    assert [lay.describe() for lay in layouts(3)] == [
        "1 colocated", "2 colocated", "3 colocated", "1P+1D", "1P+2D", "2P+1D"]
    with pytest.raises(ValueError, match="prefill pool needs decode"):
        Layout(prefill=1)
    with pytest.raises(ValueError, match="rate"):
        TrafficMix(rate=0)


def test_long_prompts_beside_long_outputs_favour_a_prefill_pool() -> None:
    # prompts of 2000 tokens arriving while others decode: colocated, every decoding sequence
    # waits out a 1 s prefill step; a prefill pool keeps decode steps short
    costs = CostModel(0.02, 0.0005, 0.0005, 0.0, 0.0, 0.0, http_overhead_s=0.001, transfer_s_per_token=1e-6)
    workload = TrafficMix(rate=0.5, num_sessions=40, input_min=2000, input_max=2000,
                          output_min=100, output_max=100, seed=1).sample()
    ranked = search(workload, costs, Slo(ttft_p90_s=8.0, tpot_p90_s=0.03), max_workers=2)
    assert ranked[0].layout == Layout(prefill=1, decode=1) and ranked[0].meets
    assert recommendation(ranked).startswith("disaggregate: 1P+1D (2 workers)")
    colocated = next(c for c in ranked if c.layout == Layout(colocated=2))
    assert colocated.tpot_p90_s > 0.03 > ranked[0].tpot_p90_s
