"""Where each rank sits: its tensor-parallel group, its pipeline stage, the output rank.

Ranks are numbered stage-major (vLLM's order): rank = stage * tp + tp_rank. A stage's
tensor-parallel group is then consecutive ranks, which a multi-host launch keeps on one host
(their all-reduces run every layer; the pipeline's one send per step crosses hosts). The last
stage's first rank is the output rank: it samples, and its tokens are the step's.
Torch-free: the executor uses it too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLayout:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def stage(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def stage_ranks(self, stage: int) -> list[int]:
        """The tensor-parallel group of a stage, in rank order."""
        first = stage * self.tensor_parallel_size
        return list(range(first, first + self.tensor_parallel_size))

    @property
    def output_rank(self) -> int:
        return self.stage_ranks(self.pipeline_parallel_size - 1)[0]

    def peer(self, rank: int, stage: int) -> int:
        """The rank of `stage` with the same tensor-parallel rank as `rank`: where this rank's
        hidden states go (or come from), one shard-holding peer to another."""
        return stage * self.tensor_parallel_size + self.tp_rank(rank)


def stage_layers(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """[start, end) of the decoder layers a pipeline stage holds.

    vLLM's rule (`get_pp_indices`), which `tandem plan memory` also follows: equal parts, the
    remainder one each to the stages just before the last (the last also runs the final norm
    and the LM head). A stage must hold at least one layer.
    """
    if num_stages > num_layers:
        raise ValueError(f"--pipeline-parallel-size {num_stages} exceeds the model's {num_layers} layers")
    sizes = [num_layers // num_stages] * num_stages
    for index in range(2, num_layers % num_stages + 2):
        sizes[-index] += 1
    start = sum(sizes[:stage])
    return start, start + sizes[stage]
