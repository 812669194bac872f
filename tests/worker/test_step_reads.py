"""What a step of the loaded model reads (worker/step_reads.py), for the bench's own limits."""

from __future__ import annotations

import torch

from tandem.config import MoeConfig
from tandem.layers.linear import Linear, SmallStepWeights, attach_small_step_weights
from tandem.layers.moe import FusedMoE
from tandem.worker.step_reads import step_reads


def test_a_model_s_steps_read_its_layers_copies_by_step_size() -> None:
    """Two layers, one with a bf16 copy for steps of up to 2 tokens: a one-token step reads
    that copy and the other's fp32 rows, a larger one both fp32 matrices."""
    small, plain = Linear(64, 32), Linear(64, 32)
    model = torch.nn.ModuleList([small, plain])
    attach_small_step_weights(small, SmallStepWeights(max_tokens=2, format="bfloat16"))
    reads = step_reads(model)
    assert reads is not None and reads.gemm == "float32"
    assert reads.up_to == ((2, 64 * 32 * 2 + 64 * 32 * 4), (3, 2 * 64 * 32 * 4))
    assert reads.bytes_for(1) == 64 * 32 * 6 and reads.bytes_for(100) == 64 * 32 * 8


def test_a_mixture_of_experts_reports_nothing() -> None:
    """Its routed experts are read by which tokens choose them: the bench models those."""
    moe = FusedMoE(MoeConfig(num_experts=4, top_k=2, intermediate_size=16), hidden_size=32)
    model = torch.nn.ModuleList([Linear(64, 32), moe])
    assert step_reads(model) is None
    assert step_reads(torch.nn.ModuleList()) is None
