"""Greedy tokens from a bf16 copy of the LM head, proven equal to the fp32 head's argmax.

In the exact fp32 mode the LM head is the largest matrix a decode step reads (SmolLM2-135M:
113 MB of its 540 MB) and a fifth of a batched step's multiply-adds, yet a greedy step needs
one index per row, not the logits. So the head's bf16 copy (half the bytes, twice oneDNN's
rate where the CPU has AVX-512-BF16) gives approximate logits ŝ, a bound B on how far each
can be from its fp32 value s, and then only the tokens that could still be the maximum are
computed in fp32:

    max_t s_t >= max_t ŝ_t - B     and     s_t <= ŝ_t + B,

so every token with ŝ_t < max ŝ - 2B is beaten and the argmax lies among the rest, whose fp32
logits (the head's rows times the hidden state, in fp32) decide it; equal maxima go to the
lowest id, as torch.argmax does. B, per row, from bf16's unit roundoff u = 2^-8 and fp32's
accumulation error γ_K (K = hidden size): rounding h and w to bf16 moves each product by at
most (2u + u²)|h_i||w_i|, the bf16 GEMM accumulates in fp32 (γ_K) and rounds its output to
bf16 (u|ŝ|), the fp32 logit has its own γ_K; and Σ|h_i||w_i| <= ‖h‖·max_t‖w_t‖
(Cauchy-Schwarz), so one bound serves a whole row and no [rows, vocab] bound is built.

The fp32 logits of the candidates are summed in another order than a full fp32 GEMM's, as any
two GEMMs' are (the fp32 mode's GEMV already does this): greedy output stays fp32's.
"""

from __future__ import annotations

import torch

from tandem.kernels.layer_ops import LayerOpsKernel
from tandem.layers.linear import _onednn_linear, _pack, onednn_bf16_available

_U = 2.0**-8  # bf16's unit roundoff (8 significant bits)
_U32 = 2.0**-24


class BoundedGreedyHead:
    """The argmax of `hidden @ weight.T` (fp32) per row, via a bf16 copy of `weight` [V, K]."""

    # Candidates kept per row by the C pass; more (a flat distribution) and the step computes
    # its logits instead. SmolLM2-135M's greedy rows had 7-8 on average, a few hundreds and
    # more on prompts of nonsense (ad-hoc scripts).
    capacity = 4096

    def __init__(self, weight: torch.Tensor, ops: LayerOpsKernel | None = None) -> None:
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError("the bounded greedy head takes an fp32 [vocab, hidden] weight")
        self.weight = weight  # the fp32 rows the candidates are computed from (shared, not copied)
        self.ops = ops  # the C pass that finds the candidates (else torch ops, ~10x slower)
        half = weight.to(torch.bfloat16)
        self.packed = _pack(half) if onednn_bf16_available() else None
        self.half = None if self.packed is not None else half
        k = weight.shape[1]
        gamma = k * _U32 / (1 - k * _U32)
        # Relative to ‖h‖·max‖w‖: the inputs' rounding and both fp32 accumulations (the bf16
        # products summed, and the fp32 candidate's), with 1% to spare for the bounds' own fp32.
        self.norm_factor = 1.01 * ((2 * _U + _U * _U) + gamma * (1 + (1 + _U) ** 2))
        self.output_factor = 1.01 * _U / (1 - _U)  # the bf16 output's rounding, relative to |ŝ|
        self.max_row_norm = float(weight.double().norm(dim=1).max())
        self.nbytes = half.numel() * half.element_size()
        self.candidates_seen = 0  # counters for benches: candidates over rows
        self.rows_seen = 0

    def approximate(self, hidden: torch.Tensor) -> torch.Tensor:
        """ŝ [rows, vocab] in bf16."""
        half = hidden.to(torch.bfloat16)
        if self.packed is not None:
            return _onednn_linear(half, self.packed, None)
        return half @ self.half.t()

    def tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """Each row's fp32-argmax token id; hidden [rows, K] fp32. None when a row has no
        candidate (a NaN in it) or too many: the caller computes the logits."""
        approx = self.approximate(hidden)
        norm_terms = self.norm_factor * hidden.double().norm(dim=1) * self.max_row_norm
        if self.ops is not None and self.ops.takes_candidates(approx):
            counts, kept = self.ops.bounded_candidates(approx, norm_terms, self.output_factor, self.capacity)
            if bool(((counts == 0) | (counts > self.capacity)).any()):
                return None
            valid = torch.arange(self.capacity).unsqueeze(0) < counts.unsqueeze(1)
            ids = kept[valid]
            rows = valid.nonzero(as_tuple=True)[0]
        else:
            rows, ids, counts = self._candidates_torch(approx, norm_terms)
            if counts is None:
                return None
        self.candidates_seen += int(ids.numel())
        self.rows_seen += hidden.shape[0]
        exact = (hidden[rows] * self.weight[ids]).sum(dim=1)
        return _argmax_by_row(counts.tolist(), ids, exact)

    def _candidates_torch(self, approx: torch.Tensor, norm_terms: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The C pass's candidates with torch ops: (rows, ids, counts), counts None on a NaN row."""
        low, high = torch.aminmax(approx, dim=1)
        largest = torch.maximum(high.abs(), low.abs()).double()
        threshold = high.double() - 2 * (norm_terms + self.output_factor * largest + 1e-30)
        # Compared in bf16: the threshold moved down by a bf16 step (2^-7 of it) before it is
        # rounded to nearest (half a step at most), so it only lets more tokens in.
        threshold = (threshold - threshold.abs() * 2.0**-7).to(torch.bfloat16)
        rows, ids = (approx >= threshold.unsqueeze(1)).nonzero(as_tuple=True)
        counts = torch.bincount(rows, minlength=approx.shape[0])
        return rows, ids, None if bool((counts == 0).any()) else counts


def _argmax_by_row(counts: list[int], ids: torch.Tensor, values: torch.Tensor) -> list[int]:
    """For each row (`counts[r]` consecutive entries), the id of its largest value, the
    lowest id among equal ones (nonzero lists a row's ids in ascending order)."""
    chosen = []
    start = 0
    for count in counts:
        chosen.append(int(ids[start + int(values[start:start + count].argmax())]))
        start += count
    return chosen
