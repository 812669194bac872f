"""This rank's place in an expert-parallel group, and the collectives a MoE layer calls.

Tensor parallelism splits every expert by its intermediate size, so every rank runs every
expert that any token chose, on thin matrices, and an all-reduce sums the partial outputs
of every token. A model with many small experts (DeepSeek-V3: 256 of them, 2048 wide) makes
those GEMMs too thin to be efficient and the all-reduce carries all T x H outputs. Expert
parallelism (GShard's scheme, as vLLM and DeepEP apply it) splits the experts instead: each
rank holds whole experts, a contiguous `1/size` of them, and a token's hidden state travels
to the ranks of the experts it chose and back.

One MoE step over the group, whose ranks all hold the same input x [T, H]:
1. each rank takes its own contiguous, as-even-as-possible slice of the T tokens
   (`token_slice`; a rank may have none) and routes it (the router is whole on each rank);
2. dispatch: the rank counts its (token, choice) rows per expert and exchanges those
   counts (`exchange_counts`, an even all-to-all), then sends each row to the rank that owns
   its expert, sorted by expert (`all_to_all`, an all-to-all with uneven splits); the counts
   per expert tell the receiver which of its experts each row is for, so no expert ids travel;
3. each rank runs its local experts on the rows it received;
4. combine: the outputs go back by the reverse all-to-all, and the source rank weights and
   sums them per token;
5. every rank gets every token's output back (`all_gather_rows`), as the layer after the
   MoE expects.

The exchanges are `torch.distributed.all_to_all_single` with `input_split_sizes` /
`output_split_sizes`; gloo on torch 2.13 (CPU) supports the uneven form, ranks that send or
receive nothing included, so no emulation is needed here. A group of one (the default) is an
unsplit layer: the MoE layer then never calls these collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from tandem.distributed.group import GroupPlace


@dataclass(frozen=True)
class ExpertParallel(GroupPlace):
    kind: ClassVar[str] = "expert-parallel"

    def local_experts(self, num_experts: int) -> tuple[int, int]:
        """(first expert, count) this rank holds: the experts dealt contiguously, equal shares."""
        if num_experts % self.size:
            raise ValueError(
                f"--enable-expert-parallel: expert parallelism over {self.size} ranks does not divide "
                f"the model's {num_experts} experts"
            )
        count = num_experts // self.size
        return self.rank * count, count

    def token_slice(self, tokens: int, rank: int | None = None) -> tuple[int, int]:
        """(start, count) of `rank`'s (default: this rank's) share of `tokens` rows, as even as
        possible: the first `tokens % size` ranks take one more; ranks past `tokens` take none."""
        rank = self.rank if rank is None else rank
        base, extra = divmod(tokens, self.size)
        return rank * base + min(rank, extra), base + (rank < extra)

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Row `r` of `counts` [size, ...] goes to rank `r`; returns [size, ...] whose row `s`
        came from rank `s` (how many rows each peer will send, before the rows themselves)."""
        counts = counts.contiguous()
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        return received

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Send the first `send_counts[0]` rows of `x` to rank 0, the next `send_counts[1]` to
        rank 1, ...; returns the rows received, grouped by source rank in rank order."""
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_counts,
                               input_split_sizes=send_counts, group=self.group)
        return out

    def all_gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Concatenate every rank's rows in rank order, rank `r` holding `counts[r]` of them
        (`x` has `counts[self.rank]`). all_gather wants equal shapes: each share is padded to the
        largest and trimmed after."""
        largest = max(counts)
        if largest == 0:
            return x
        if x.shape[0] < largest:
            x = torch.cat([x, x.new_zeros((largest - x.shape[0], *x.shape[1:]))])
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])

