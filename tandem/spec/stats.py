"""Speculation counters, vLLM's (`vllm/v1/spec_decode/metrics.py`), cumulative. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verifications that checked at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose i-th token held

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position += [0] * (num_proposed - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification, the target's own token included (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
        }
