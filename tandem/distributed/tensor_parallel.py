"""This rank's place in a tensor-parallel group, and the collectives its layers call.

Tensor parallelism splits every large matrix of a layer over the group (Megatron's scheme,
as vLLM and gpt-fast apply it): projections that fan out (q/k/v, gate/up) keep a slice of
their output rows, so each rank computes its own heads or intermediate slice with no
communication; projections that fan back in (o_proj, down_proj) keep the matching slice of
their input columns, and one all-reduce sums the partial outputs. The embedding and the LM
head are split by vocabulary: a token's row lives on one rank (an all-reduce fills in the
rest), and each rank scores its slice of the vocabulary (an all-gather joins the logits).
A group of one (the default) is the unsplit model: every method below is then a no-op, so
single-rank runs take exactly the code path they always did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from tandem.distributed.group import GroupPlace
from tandem.platform.profiling import profiled


@dataclass(frozen=True)
class TensorParallel(GroupPlace):
    kind: ClassVar[str] = "tensor-parallel"

    def divide(self, total: int, what: str) -> int:
        """`total` / size, refusing sizes that do not divide it (heads, KV heads, intermediate)."""
        if total % self.size:
            raise ValueError(
                f"--tensor-parallel-size {self.size} does not divide the model's {what} ({total})"
            )
        return total // self.size

    def part(self, units: int, unit_size: int = 1) -> tuple[int, int]:
        """This rank's (start, length), in elements, of `units` indivisible units of
        `unit_size` each, dealt as evenly as possible (the first ranks take one more).

        Attention heads are dealt this way by KV group (a KV head with its query heads), so a
        model whose head count the group size does not divide still splits: SmolLM2's 3 KV
        heads over 2 ranks are 2 + 1, with 6 + 3 query heads.
        """
        base, extra = divmod(units, self.size)
        if base == 0:
            raise ValueError(f"--tensor-parallel-size {self.size} exceeds the model's {units} KV heads")
        start = self.rank * base + min(self.rank, extra)
        return start * unit_size, (base + (self.rank < extra)) * unit_size

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's equal slice of `tensor` along `dim` (a view: nothing is copied yet)."""
        if not self.split:
            return tensor
        length = self.divide(tensor.shape[dim], f"dimension {dim} of a {tuple(tensor.shape)} weight")
        return tensor.narrow(dim, self.rank * length, length)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.split:
            with profiled("tp.all_reduce"):
                dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if not self.split:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with profiled("tp.all_gather"):
            dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE_RANK = TensorParallel()
