"""The bounded greedy head: bf16 logits, a proven bound, fp32 logits for the candidates only.
Its tokens must be the fp32 logits' argmax (summed as its candidates are), including where
bf16 alone would pick another token, with ties to the lowest id as torch.argmax breaks them."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.layer_ops import LayerOpsKernel
from tandem.layers.bounded_greedy import BoundedGreedyHead


@pytest.fixture(scope="module", params=["c", "torch"])
def ops(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LayerOpsKernel | None:
    """The candidates found by the C pass, and by the torch ops that stand in without it."""
    return LayerOpsKernel.build(tmp_path_factory.mktemp("cache")) if request.param == "c" else None


def _fp32_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> list[int]:
    return [int((row * weight).sum(dim=1).argmax()) for row in hidden]


def test_tokens_are_the_fp32_argmax_on_random_heads(ops: LayerOpsKernel | None) -> None:
    torch.manual_seed(0)
    weight = torch.randn(5000, 576) * 0.05
    hidden = torch.randn(64, 576) * 3
    head = BoundedGreedyHead(weight, ops)
    assert head.tokens(hidden) == _fp32_argmax(hidden, weight)
    assert head.rows_seen == 64 and head.candidates_seen >= 64
    assert head.tokens(hidden[:1]) == _fp32_argmax(hidden[:1], weight)  # one row (padded for oneDNN)


def test_near_ties_that_bf16_gets_wrong_are_settled_in_fp32(ops: LayerOpsKernel | None) -> None:
    """Rows 1 and 2 cancel large weights: fp32 puts row 2 ahead (1.04 against 1.02), bf16's
    rounding (steps of 0.5 there) puts row 1 ahead (1.5 against 1.0). The head must answer
    row 2, and a bound without the inputs' rounding would not."""
    weight = torch.full((300, 64), -0.01)
    weight[1, :2] = torch.tensor([100.76, -99.74])
    weight[2, :2] = torch.tensor([100.74, -99.70])
    hidden = torch.zeros(1, 64)
    hidden[0, :2] = 1.0
    exact = _fp32_argmax(hidden, weight)
    assert exact == [2]
    approx = (hidden.bfloat16() @ weight.bfloat16().t()).float()
    assert approx[0, 1] > approx[0, 2]  # bf16 alone would answer 1
    assert BoundedGreedyHead(weight, ops).tokens(hidden) == exact
    broken = BoundedGreedyHead(weight, ops)
    broken.norm_factor = 0.0
    assert broken.tokens(hidden) == [1]  # the test can tell a bound that is too small


def test_equal_maxima_go_to_the_lowest_id(ops: LayerOpsKernel | None) -> None:
    weight = torch.zeros(10, 32)
    weight[3] = 1.0
    weight[7] = 1.0
    hidden = torch.ones(2, 32)
    assert BoundedGreedyHead(weight, ops).tokens(hidden) == [3, 3]


def test_a_nan_row_falls_back_to_the_logits(ops: LayerOpsKernel | None) -> None:
    weight = torch.randn(100, 32)
    hidden = torch.randn(2, 32)
    hidden[1, 4] = float("nan")
    assert BoundedGreedyHead(weight, ops).tokens(hidden) is None


def test_too_many_candidates_fall_back_to_the_logits(ops: LayerOpsKernel | None) -> None:
    """A flat row (every logit within the bound) has more candidates than the C pass keeps;
    the torch ops keep them all and still answer fp32's argmax."""
    torch.manual_seed(2)
    weight = torch.ones(5000, 32) + torch.randn(5000, 32) * 1e-6  # above the 4,096 kept
    hidden = torch.randn(1, 32)
    tokens = BoundedGreedyHead(weight, ops).tokens(hidden)
    assert tokens is None if ops is not None else tokens == _fp32_argmax(hidden, weight)


def test_a_bf16_head_s_greedy_ids_are_its_fp32_logits_argmax(ops: LayerOpsKernel | None) -> None:
    """A bf16 run's greedy step takes the argmax of the head's bf16 products, not of the fp32
    copy forward makes: the same index, ties included (two equal vocabulary rows, and the
    equal logits bf16's rounding makes), whether the C pass or torch takes it."""
    from tandem.layers.embedding import LMHead

    generator = torch.Generator().manual_seed(12)
    head = LMHead(512, 64).to(torch.bfloat16)
    head.weight.data.copy_(torch.randn(512, 64, generator=generator))
    head.weight.data[300] = head.weight.data[7] * 3  # row 7's logits times 3: often the largest
    head.weight.data[301] = head.weight.data[300]  # an exact tie with row 300: 300 wins
    hidden = torch.randn(9, 64, generator=generator).bfloat16()
    logits = head(hidden)
    assert logits.dtype == torch.float32
    ids = head.greedy_ids(hidden, ops)
    assert ids.tolist() == logits.argmax(dim=-1).tolist()
    assert 301 not in ids.tolist() and (ids == 300).any()
