"""The LM head's greedy ids: the argmax of its own products, found in the packed GEMM where the
kernel can (bf16 on AMX's tiles) without writing the logits, and from the logits elsewhere."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.dense_gemm import DenseGemmKernel, load_dense_gemm_kernel
from tandem.kernels.layer_ops import load_layer_ops
from tandem.layers.embedding import LMHead
from tandem.layers.linear import SmallStepWeights


@pytest.fixture(scope="module")
def gemm(tmp_path_factory: pytest.TempPathFactory) -> DenseGemmKernel:
    built = load_dense_gemm_kernel(tmp_path_factory.mktemp("cache"))
    if built is None or not built.multiplies(torch.bfloat16):
        pytest.skip("no packed bf16 GEMM on this CPU")
    return built


def _head(vocab: int, hidden: int, generator: torch.Generator) -> LMHead:
    head = LMHead(vocab, hidden)
    head.weight.data.copy_(torch.randn(vocab, hidden, generator=generator) / hidden ** 0.5)
    return head.to(torch.bfloat16)


def test_greedy_ids_are_the_argmax_of_the_heads_logits(gemm: DenseGemmKernel, tmp_path) -> None:
    generator = torch.Generator().manual_seed(2)
    head = _head(8192, 576, generator)
    head.pack_for_cpu(drop_dense=False, dense_gemm=gemm)
    ops = load_layer_ops(tmp_path)
    for rows in (3, 64):
        hidden = torch.randn(rows, 576, generator=generator).bfloat16()
        want = head.linear(hidden).argmax(dim=-1)
        fused = head.dense_argmax(hidden)
        assert (fused is not None) == (gemm.isa == "amx-bf16")
        assert torch.equal(head.greedy_ids(hidden, ops), want)
        assert torch.equal(head.greedy_ids(hidden, None), want)


def test_steps_another_copy_takes_leave_the_argmax_to_the_logits(gemm: DenseGemmKernel) -> None:
    """A one-token step that reads the head's small-step copy: the packed GEMM does not run, so
    it does not find the ids either."""
    generator = torch.Generator().manual_seed(3)
    head = _head(4096, 576, generator)
    head.pack_for_cpu(drop_dense=False, dense_gemm=gemm)
    head.small_step = SmallStepWeights(max_tokens=2, format="bfloat16")
    head.small_weight = head.weight.detach().clone()
    head.small_bias = None
    one = torch.randn(1, 576, generator=generator).bfloat16()
    assert head.dense_argmax(one) is None
    assert torch.equal(head.greedy_ids(one, None), head.linear(one).argmax(dim=-1))
