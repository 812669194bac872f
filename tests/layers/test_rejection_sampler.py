"""Verification of drafts: exact for greedy, distribution-preserving for sampling.

The statistical tests draw thousands of verifications on a six-token vocabulary and compare
the emitted tokens with the distribution the normal sampler would draw from (chi-square).
Each also runs the same test on a deliberately biased verifier (one that keeps every draft)
and checks the test rejects it, so a pass means something.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tandem.layers.rejection_sampler import DraftedRequest, RejectionSampler
from tandem.layers.sampler import Sampler
from tandem.types import SamplingParams

VOCAB = 6
DRAWS = 3000


def verifier() -> RejectionSampler:
    return RejectionSampler(Sampler(seed=1))


def request(params: SamplingParams, drafts: list[int], **rest) -> DraftedRequest:
    return DraftedRequest(params, [1, 2, 3], [], drafts, **rest)


def tokens(kept) -> list[int]:
    return [t.token_id for t in kept]


def test_greedy_keeps_the_argmax_up_to_the_first_mismatch() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(dim=-1).tolist()
    greedy = SamplingParams(temperature=0)
    [kept] = verifier()(logits, [request(greedy, [best[0], best[1], (best[2] + 1) % 50])])
    assert tokens(kept) == best[:3]
    [kept] = verifier()(logits, [request(greedy, best[:3])])
    assert tokens(kept) == best  # every draft held: the bonus token comes too
    [kept] = verifier()(logits[:2], [request(greedy, [(best[0] + 1) % 50])])
    assert tokens(kept) == best[:1]


def test_rows_are_split_between_requests_in_order() -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(1))
    best = logits.argmax(dim=-1).tolist()
    greedy = SamplingParams(temperature=0)
    kept = verifier()(logits, [request(greedy, [best[0], best[1]]), request(greedy, []),
                               request(greedy, [best[4]])])
    assert [tokens(k) for k in kept] == [best[:3], best[3:4], best[4:6]]
    with pytest.raises(ValueError):
        verifier()(logits, [request(greedy, [1])])


def test_penalties_and_min_tokens_see_the_drafts_before_each_row() -> None:
    logits = torch.zeros(3, 10)
    logits[:, 4] = 5.0  # every row prefers token 4...
    logits[:, 6] = 4.0
    params = SamplingParams(temperature=0, repetition_penalty=100.0)
    # ...but once 4 is in the output (the first draft), row 1 is penalised away from it.
    [kept] = verifier()(logits, [request(params, [4, 4])])
    assert tokens(kept) == [4, 6]
    eos_first = torch.zeros(3, 10)
    eos_first[:, 2] = 9.0  # EOS
    eos_first[:, 5] = 1.0
    params = SamplingParams(temperature=0, min_tokens=1)
    [kept] = verifier()(eos_first, [request(params, [5, 2], min_tokens_banned=[2])])
    assert tokens(kept) == [5, 2, 2]  # banned at row 0 only: the output is one token long at row 1
    params = SamplingParams(temperature=0, min_tokens=2)
    [kept] = verifier()(eos_first, [request(params, [5, 2], min_tokens_banned=[2])])
    assert tokens(kept) == [5, 5]  # banned at rows 0 and 1


def test_logprobs_come_with_every_kept_token() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    best = logits.argmax(dim=-1).tolist()
    [kept] = verifier()(logits, [request(SamplingParams(temperature=0, logprobs=2), best[:2])])
    raw = torch.log_softmax(logits, dim=-1)
    assert len(kept) == 3
    for row, token in enumerate(kept):
        assert token.logprob == pytest.approx(float(raw[row, token.token_id]))
        assert len(token.top_logprobs) == 3


def target(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """The normal sampler's distribution, computed here independently (numpy)."""
    x = logits.double().numpy() / params.temperature
    order = np.argsort(-x)
    keep = np.zeros_like(x, dtype=bool)
    keep[order[: params.top_k or len(x)]] = True
    p = np.exp(x - x.max()) * keep
    return p / p.sum()


def first_tokens(verify, logits: torch.Tensor, params: SamplingParams, drafts_of, seed: int) -> np.ndarray:
    counts = np.zeros(VOCAB)
    rng = torch.Generator().manual_seed(seed)
    for _ in range(DRAWS):
        drafts, q = drafts_of(rng)
        [kept] = verify(logits, [request(params, drafts, draft_probs=q, generator=rng)])
        counts[kept[0].token_id] += 1
    return counts


def consistent(counts: np.ndarray, p: np.ndarray) -> bool:
    support = p > 0
    if counts[~support].sum():
        return False
    return chisquare(counts[support], p[support] * counts.sum()).pvalue > 1e-3


def keep_every_draft(logits: torch.Tensor, requests: list[DraftedRequest]):
    """A biased verifier: trusts the draft."""
    return [[type("T", (), {"token_id": r.draft_token_ids[0]})()] for r in requests]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)])
def test_point_mass_drafts_leave_the_target_distribution_unchanged(params: SamplingParams) -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0], [0.0, 1.0, 2.0, 0.0, 0.0, 0.0]])
    p = target(logits[0], params)

    def fixed_draft(rng):
        return [1], None  # a plausible but not the likeliest token

    assert consistent(first_tokens(verifier(), logits, params, fixed_draft, 3), p)
    assert not consistent(first_tokens(keep_every_draft, logits, params, fixed_draft, 3), p)


def test_drafts_from_a_distribution_q_leave_the_target_distribution_unchanged() -> None:
    params = SamplingParams(temperature=1.0)
    logits = torch.tensor([[1.5, 1.0, 0.2, 0.0, -1.0, 0.3], [0.0] * VOCAB])
    p = target(logits[0], params)
    q = torch.tensor([0.05, 0.1, 0.4, 0.3, 0.1, 0.05])  # a poor draft: mass where p has little

    def from_q(rng):
        draft = int(torch.multinomial(q, 1, generator=rng))
        return [draft], q.unsqueeze(0)

    assert consistent(first_tokens(verifier(), logits, params, from_q, 4), p)
    assert not consistent(first_tokens(keep_every_draft, logits, params, from_q, 4), p)


def test_the_token_after_an_accepted_draft_follows_the_next_row() -> None:
    """Two drafts; when the first holds, the second emitted token is distributed as row 1's p."""
    params = SamplingParams(temperature=1.0)
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.2, 1.0, 0.0, 1.5, -1.0, 0.5], [0.0] * VOCAB])
    counts = np.zeros(VOCAB)
    rng = torch.Generator().manual_seed(5)
    sampler = verifier()
    while counts.sum() < DRAWS:
        [kept] = sampler(logits, [request(params, [0, 3], generator=rng)])
        if kept[0].token_id == 0:
            counts[kept[1].token_id] += 1
    assert consistent(counts, target(logits[1], params))


def test_a_seeded_request_repeats_itself() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    runs = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(7)
        runs.append([tokens(verifier()(logits, [request(params, [1, 2, 3, 4], generator=generator)])[0])
                     for _ in range(20)])
    assert runs[0] == runs[1]
