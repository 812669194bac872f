"""A rank's place in a group of ranks that share one job (tensor- or expert-parallel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class GroupPlace:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None: the default group
    kind: ClassVar[str] = "group"  # named in errors

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"{self.kind} rank {self.rank} of {self.size} is not a valid place")

    @property
    def split(self) -> bool:
        return self.size > 1
