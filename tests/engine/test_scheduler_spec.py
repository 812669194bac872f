"""The scheduler with speculative decoding, over the fake model (conftest).

The fake model verifies drafts greedily against its own next-token function and asserts,
for every chunk, that the KV memory holds exactly the context (drafts included) and that no
published or shared block is ever written. So a rejected draft left in a published block, a
block table missing the blocks allocated for drafts, or a wrong rollback of
`num_computed_tokens` fails these tests instead of passing silently.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.config import SpeculativeConfig
from tandem.spec.proposer import TokenProposer
from tandem.spec.speculator import Speculator
from tandem.types import RequestStatus
from tests.engine.conftest import VOCAB_HIGH, next_token


class ScriptedProposer(TokenProposer):
    """Proposes `right` tokens the fake model will accept, then wrong ones (never sampled)."""

    name = "scripted"

    def __init__(self, right: int, wrong: int = 0) -> None:
        self.right, self.wrong = right, wrong
        self.finished: list[str] = []
        self.calls = 0

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:
        self.calls += 1
        context = list(token_ids)
        drafts = []
        for _ in range(self.right):
            context.append(next_token(context))
            drafts.append(context[-1])
        drafts += [VOCAB_HIGH + 1 + i for i in range(self.wrong)]
        return drafts[:max_tokens]

    def request_finished(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.finished.append(request_id)


def speculator(proposer: TokenProposer, k: int = 4) -> Speculator:
    return Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=False), proposer)


def test_accepted_drafts_give_the_reference_output_in_fewer_steps(make_engine, reference) -> None:
    plain = make_engine()
    plain.add("a", list(range(10, 20)), max_tokens=24)
    plain_steps = plain.run()
    eng = make_engine(speculator=speculator(ScriptedProposer(right=4)))
    request = eng.add("a", list(range(10, 20)), max_tokens=24)
    steps = eng.run()
    assert request.output_token_ids == reference(list(range(10, 20)), 24)
    assert steps < plain_steps / 3
    stats = eng.scheduler.speculator.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.accepted_per_position[0] == stats.num_drafts


def test_rejected_drafts_roll_back_and_the_output_is_unchanged(make_engine, reference) -> None:
    for right, wrong in ((0, 4), (1, 3), (2, 2), (3, 1)):
        eng = make_engine(speculator=speculator(ScriptedProposer(right, wrong)))
        prompts = {f"r{i}": [11 + i] + list(range(30, 30 + 5 + 3 * i)) for i in range(4)}
        requests = {rid: eng.add(rid, prompt, max_tokens=13) for rid, prompt in prompts.items()}
        eng.run()
        for rid, request in requests.items():
            assert request.output_token_ids == reference(prompts[rid], 13), (right, wrong, rid)
        stats = eng.scheduler.speculator.stats
        assert stats.num_accepted_tokens == right * stats.num_drafts  # each draft keeps its right part
        assert stats.accepted_per_position[right] == 0


def test_drafts_respect_max_tokens_and_the_token_budget(make_engine) -> None:
    eng = make_engine(max_num_batched_tokens=12, speculator=speculator(ScriptedProposer(right=8), k=8))
    requests = [eng.add(f"r{i}", [20 + i, 21, 22], max_tokens=5 + i) for i in range(3)]
    eng.run()  # check_schedule asserts the budget every step
    for i, request in enumerate(requests):
        assert request.num_output_tokens == 5 + i
        assert eng.finished[request.request_id].reason == RequestStatus.FINISHED_LENGTH
    assert max(len(d) for out in eng.outputs for d in out.spec_token_ids.values()) <= 7


def test_a_stop_token_inside_the_accepted_drafts_ends_the_request_there(make_engine, reference) -> None:
    prompt = list(range(40, 50))
    expected = reference(prompt, 20)
    eng = make_engine(speculator=speculator(ScriptedProposer(right=6), k=6))
    request = eng.add("a", prompt, max_tokens=20, stop_token_ids=[expected[4]])
    eng.run()
    assert request.output_token_ids == expected[:5]
    assert eng.finished["a"].reason == RequestStatus.FINISHED_STOPPED


def test_only_accepted_full_blocks_reach_the_prefix_cache(make_engine, reference) -> None:
    """A second request over the first's prompt and output reuses its blocks; the fake model
    checks every reused slot holds the right token, so a block published with a rejected
    draft in it would fail here."""
    prompt = list(range(60, 71))
    eng = make_engine(speculator=speculator(ScriptedProposer(right=1, wrong=2)))
    first = eng.add("a", prompt, max_tokens=14)
    eng.run()
    again = prompt + first.output_token_ids
    second = eng.add("b", again, max_tokens=6)
    eng.run()
    assert second.num_cached_tokens >= 16
    assert second.output_token_ids == reference(again, 6)


def test_no_room_for_drafts_means_no_drafts_not_a_preemption(make_engine, reference) -> None:
    eng = make_engine(num_blocks=6, speculator=speculator(ScriptedProposer(right=4), k=4))
    prompt = list(range(10, 30))  # 5 blocks of 4: one block left, not enough for a full window
    request = eng.add("a", prompt, max_tokens=3)
    eng.run()
    assert request.output_token_ids == reference(prompt, 3)
    assert eng.scheduler.num_preemptions == 0


def test_a_request_can_opt_out(make_engine, reference) -> None:
    proposer = ScriptedProposer(right=4)
    eng = make_engine(speculator=speculator(proposer))
    opted_out = eng.add("quiet", [5, 6, 7], max_tokens=6, speculate=False)
    eng.run()
    assert proposer.calls == 0
    assert all(not out.spec_token_ids for out in eng.outputs)
    assert opted_out.output_token_ids == reference([5, 6, 7], 6)


def test_the_proposer_hears_when_requests_end(make_engine) -> None:
    proposer = ScriptedProposer(right=2)
    eng = make_engine(speculator=speculator(proposer))
    eng.add("a", [5, 6, 7], max_tokens=4)
    eng.add("b", [5, 6, 8], max_tokens=40)
    eng.step()
    eng.scheduler.abort(["b"])
    eng.run()
    assert sorted(proposer.finished) == ["a", "b"]
