"""Sampler behaviour on a small vocabulary, checked statistically where sampling is random."""

from __future__ import annotations

import torch

from tandem.layers.sampler import Sampler, SamplingRow
from tandem.types import SamplingParams

VOCAB = 12
DRAWS = 3000


def _logits(rows: int = 1) -> torch.Tensor:
    base = torch.linspace(2.0, -2.0, VOCAB)  # token 0 most likely, token 11 least
    return base.repeat(rows, 1)


def _draw_many(params: SamplingParams, logits: torch.Tensor | None = None) -> torch.Tensor:
    sampler = Sampler(seed=0)
    logits = _logits(DRAWS) if logits is None else logits.repeat(DRAWS, 1)
    rows = [SamplingRow(params, [], []) for _ in range(DRAWS)]
    return torch.tensor([s.token_id for s in sampler(logits, rows)])


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, VOCAB)
    rows = [SamplingRow(SamplingParams(temperature=0), [], []) for _ in range(5)]
    tokens = [s.token_id for s in Sampler()(logits, rows)]
    assert tokens == logits.argmax(dim=-1).tolist()


def test_top_k_never_leaves_its_set() -> None:
    tokens = _draw_many(SamplingParams(temperature=1.0, top_k=3))
    assert set(tokens.tolist()) == {0, 1, 2}


def test_top_p_never_leaves_the_nucleus() -> None:
    probs = torch.softmax(_logits()[0], dim=-1)
    cumulative = probs.cumsum(0)
    nucleus = int((cumulative < 0.6).sum()) + 1  # smallest prefix with mass >= 0.6
    tokens = _draw_many(SamplingParams(temperature=1.0, top_p=0.6))
    assert set(tokens.tolist()) == set(range(nucleus))


def test_min_p_drops_unlikely_tokens() -> None:
    probs = torch.softmax(_logits()[0], dim=-1)
    allowed = {i for i in range(VOCAB) if probs[i] >= 0.3 * probs[0]}
    tokens = _draw_many(SamplingParams(temperature=1.0, min_p=0.3))
    assert set(tokens.tolist()) == allowed


def test_unfiltered_draws_follow_the_distribution() -> None:
    probs = torch.softmax(_logits()[0] / 0.7, dim=-1)
    tokens = _draw_many(SamplingParams(temperature=0.7))
    freq = torch.bincount(tokens, minlength=VOCAB).float() / DRAWS
    # 3000 draws: a 4-sigma band on each frequency
    sigma = (probs * (1 - probs) / DRAWS).sqrt()
    assert torch.all((freq - probs).abs() <= 4 * sigma + 1e-3)


def test_seed_reproducible_regardless_of_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=7)

    def run(extra_rows: int) -> list[int]:
        sampler = Sampler(seed=extra_rows)
        generator = torch.Generator().manual_seed(7)
        picked = []
        for _ in range(20):
            rows = [SamplingRow(params, [], [], generator)] + [
                SamplingRow(SamplingParams(temperature=1.0), [], []) for _ in range(extra_rows)
            ]
            picked.append(sampler(_logits(1 + extra_rows), rows)[0].token_id)
        return picked

    assert run(0) == run(5)


def test_penalties_discourage_seen_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 1.0
    logits[0, 4] = 0.9
    sampler = Sampler()
    greedy = SamplingParams(temperature=0)
    assert sampler(logits, [SamplingRow(greedy, [], [])])[0].token_id == 3
    rep = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert sampler(logits, [SamplingRow(rep, [3], [])])[0].token_id == 4
    freq = SamplingParams(temperature=0, frequency_penalty=0.2)
    assert sampler(logits, [SamplingRow(freq, [], [3])])[0].token_id == 4
    presence = SamplingParams(temperature=0, presence_penalty=0.2)
    assert sampler(logits, [SamplingRow(presence, [3], [])])[0].token_id == 3  # prompt tokens don't count
    assert sampler(logits, [SamplingRow(presence, [], [3])])[0].token_id == 4


def test_banned_tokens_are_never_drawn() -> None:
    rows = [SamplingRow(SamplingParams(temperature=0), [], [], banned_token_ids=[0])]
    assert Sampler()(_logits(), rows)[0].token_id == 1


def test_logprobs_are_raw_model_logprobs() -> None:
    logits = torch.randn(1, VOCAB)
    out = Sampler()(logits, [SamplingRow(SamplingParams(temperature=0, logprobs=2), [], [])])[0]
    expected = torch.log_softmax(logits[0], dim=-1)
    assert out.logprob == torch.max(expected).item()
    assert [e.token_id for e in out.top_logprobs[1:]] == expected.topk(2).indices.tolist()


def test_greedy_rows_take_the_c_argmax_where_attached(tmp_path) -> None:
    """The runner hands the sampler the layer-op kernel; greedy rows, plain or among sampled
    ones, then read their token from its argmax, the same token torch's gives."""
    from tandem.kernels.layer_ops import LayerOpsKernel

    ops = LayerOpsKernel.build(tmp_path)
    calls = []
    argmax = ops.argmax
    ops.argmax = lambda x: calls.append(tuple(x.shape)) or argmax(x)
    sampler = Sampler(ops=ops)
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(3))
    assert [t.token_id for t in sampler.argmax(logits)] == logits.argmax(-1).tolist()
    rows = [SamplingRow(SamplingParams(temperature=0), [], []),
            SamplingRow(SamplingParams(temperature=1.0, seed=1), [], []),
            SamplingRow(SamplingParams(temperature=0, logprobs=1), [], [])]
    out = sampler(logits, rows)
    assert out[0].token_id == int(logits[0].argmax()) and out[2].token_id == int(logits[2].argmax())
    assert calls == [(3, 300), (2, 300)]
