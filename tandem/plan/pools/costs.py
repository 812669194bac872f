"""What one engine step costs, as a function of what is in it; fitted to measured steps.

    step_s = a + b_p * prompt tokens + b_d * decode tokens
               + c_p * prompt attention pairs + c_d * decode attention pairs + d * sequences

The weights are read once a step (`a`); every token computed costs its share of the matmuls,
a prompt token (`b_p`, in a large GEMM) and a decoding sequence's token (`b_d`, in a thin
one) apart. Attention pairs count query-key products, n * (context + (n + 1) / 2) for n new
tokens after `context` cached ones: prompt attention is compute-bound (`c_p`) while decode
attention reads the whole cached context for one query (`c_d`, memory-bound, dearer per
pair). `sequences` is per-sequence work (sampling, bookkeeping). A non-negative
least-squares fit over a grid of measured prefill and decode steps pins the six down.

The KV handoff between a prefill and a decode worker costs `transfer_s_per_token` a token
plus a fixed `transfer_fixed_s` (the hop's round trips), and every request pays
`http_overhead_s` per HTTP hop.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class StepShape:
    """What one step computes: the prompt chunks (new tokens, cached context before them) and
    the decoding sequences' contexts."""

    prefill: tuple[tuple[int, int], ...] = ()
    decode_contexts: tuple[int, ...] = ()

    def features(self) -> tuple[float, ...]:
        prompt_tokens = sum(n for n, _ in self.prefill)
        prompt_pairs = sum(n * (ctx + (n + 1) / 2) for n, ctx in self.prefill)
        decode_pairs = sum(ctx + 1 for ctx in self.decode_contexts)
        sequences = len(self.prefill) + len(self.decode_contexts)
        return (1.0, float(prompt_tokens), float(len(self.decode_contexts)), float(prompt_pairs),
                float(decode_pairs), float(sequences))


@dataclass(frozen=True)
class Measurement:
    """One measured step (or the average of several alike)."""

    shape: StepShape
    seconds: float


# The KV block size of every engine before a CPU's default became 64 tokens (2026-12-06), so of
# every profile that does not say its own.
LEGACY_PROFILE_BLOCK_SIZE = 16


@dataclass
class CostModel:
    """Fitted step costs plus the handoff and HTTP costs, as `tandem plan profile` writes them."""

    fixed_s: float  # a
    per_prompt_token_s: float  # b_p
    per_decode_token_s: float  # b_d
    per_prompt_pair_s: float  # c_p
    per_decode_pair_s: float  # c_d
    per_sequence_s: float  # d
    transfer_s_per_token: float = 0.0
    transfer_fixed_s: float = 0.0
    http_overhead_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def block_size(self) -> int:
        """Tokens per KV block of the engine the profile measured: the simulator caches prefixes
        in whole blocks of it. A profile written before the field measured blocks of 16, then
        every engine's default."""
        value = self.meta.get("block_size", LEGACY_PROFILE_BLOCK_SIZE)
        valid = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        return value if valid else LEGACY_PROFILE_BLOCK_SIZE

    @property
    def coefficients(self) -> tuple[float, ...]:
        return (self.fixed_s, self.per_prompt_token_s, self.per_decode_token_s, self.per_prompt_pair_s,
                self.per_decode_pair_s, self.per_sequence_s)

    def step_s(self, shape: StepShape) -> float:
        return sum(c * f for c, f in zip(self.coefficients, shape.features(), strict=True))

    def transfer_s(self, tokens: int) -> float:
        return self.transfer_fixed_s + self.transfer_s_per_token * tokens

    @classmethod
    def fit(cls, measurements: Sequence[Measurement], **extra: Any) -> CostModel:
        """Non-negative least squares on relative error, so short decode steps weigh as much
        as long prefills."""
        if len(measurements) < 6:
            raise ValueError(f"need at least 6 measured steps to fit 6 costs, got {len(measurements)}")
        x = np.array([m.shape.features() for m in measurements], dtype=np.float64)
        y = np.array([m.seconds for m in measurements], dtype=np.float64)
        weights = 1.0 / np.maximum(y, 1e-9)
        coef = _nnls(x * weights[:, None], y * weights)
        return cls(*map(float, coef), **extra)

    def relative_errors(self, measurements: Sequence[Measurement]) -> list[float]:
        return [self.step_s(m.shape) / m.seconds - 1.0 for m in measurements]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> CostModel:
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except (OSError, json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"{path} is not a profile written by `tandem plan profile`: {exc}") from exc


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a cost cannot be negative): drop the most
    negative coefficient and refit until none is (exact for our 6 columns, by enumeration of
    the column subsets)."""
    n = a.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for mask in range(1, 1 << n):
        cols = [i for i in range(n) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(n)
        full[cols] = coef
        residual = float(np.sum((a @ full - b) ** 2))
        if best is None or residual < best[0]:
            best = (residual, full)
    assert best is not None  # some single column always fits with a non-negative coefficient
    return best[1]
