"""What a step of the loaded model reads and how its larger steps multiply, for the bench's limits.

`tandem bench offline` prints each engine's share of the box's limits. Those limits are the
run dtype's: every weight read once a step in bf16 or fp32, multiplied at the dtype's matmul
rate. tandem's modes read other copies (the default mode's 4- and 8-bit decode copies, exact
fp32's lossless codes) and multiply larger steps in 8 bits under `--quantization int8`, so a
share of the dtype's limit passed 100% and told nothing about how near the mode is to its
own. The worker reports both here; the bench turns them into the mode's own limits
(bench/offline_layouts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.layers.int4_experts import Int4Experts
from tandem.layers.linear import GEMV_MAX_ROWS, LinearWeights
from tandem.layers.moe import FusedMoE


@dataclass(frozen=True)
class StepReads:
    """The weight bytes a step reads, by its size: `up_to` holds (tokens, bytes) pairs with
    ascending tokens; a step of n tokens reads the first pair's bytes whose tokens >= n, past
    the last pair the last's. `gemm`: the arithmetic steps larger than the small copies'
    multiply in ("int8" under --quantization int8, else the weights' dtype)."""

    up_to: tuple[tuple[int, int], ...]
    gemm: str

    def bytes_for(self, tokens: int) -> int:
        return next((nbytes for limit, nbytes in self.up_to if tokens <= limit), self.up_to[-1][1])


def step_reads(model: torch.nn.Module) -> StepReads | None:
    """The model's `StepReads`, whole on this rank; None for a MoE (its routed experts are
    read by which tokens choose them, which the bench models itself) or a model with no
    linear layers. The LM head counts its bounded-greedy copy where it has one (greedy steps
    read that: layers/bounded_greedy.py), the embedding nothing (a step reads a row a token)."""
    layers = [m for m in model.modules() if isinstance(m, LinearWeights)]
    if not layers or any(isinstance(m, FusedMoE | Int4Experts) for m in model.modules()):
        return None
    # the sizes where some layer switches copies: its small copy's last, the bf16 GEMV's last
    limits = {m.small_step.max_tokens for m in layers if m.small_step is not None}
    limits |= {GEMV_MAX_ROWS for m in layers if m.gemv_rows is not None}
    sizes = sorted(limits) + [max(limits, default=0) + 1]
    head = getattr(model, "lm_head", None)
    bounded = getattr(head, "bounded_greedy", None)

    def total(tokens: int) -> int:
        return sum(bounded.nbytes if m is head and bounded is not None else m.step_read_bytes(tokens)
                   for m in layers)

    dtypes = {m.weight.dtype for m in layers}
    gemm = "int8" if any(m.int8 is not None for m in layers) else str(next(iter(dtypes))).removeprefix("torch.")
    return StepReads(tuple((tokens, total(tokens)) for tokens in sizes), gemm)
