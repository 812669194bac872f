"""Where ranks sit (stage-major layout, output rank, layers per stage) and the parallel
configs that cannot run, refused with messages that say why."""

from __future__ import annotations

import pytest

from tandem.config import ParallelConfig
from tandem.distributed.layout import RankLayout, stage_layers


def test_ranks_are_laid_out_stage_major() -> None:
    layout = RankLayout(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert layout.world_size == 6
    assert [layout.stage(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [layout.tp_rank(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert layout.stage_ranks(1) == [2, 3]
    assert layout.output_rank == 4  # the last stage's first rank samples
    assert layout.peer(3, 2) == 5  # rank 3 (stage 1, tp rank 1) sends to stage 2's tp rank 1


def test_layers_are_dealt_evenly_with_the_remainder_kept_off_the_last_stage() -> None:
    assert [stage_layers(30, 2, s) for s in range(2)] == [(0, 15), (15, 30)]
    assert [stage_layers(61, 4, s) for s in range(4)] == [(0, 15), (15, 30), (30, 46), (46, 61)]
    assert [stage_layers(7, 4, s) for s in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert stage_layers(5, 1, 0) == (0, 5)


@pytest.mark.parametrize("layers, stages", [(61, 4), (61, 8), (30, 2), (7, 4), (3, 3), (94, 5)])
def test_the_engine_splits_layers_as_the_memory_plan_does(layers: int, stages: int) -> None:
    from tandem.sizing.sharding import pp_layer_ranges

    planned = [(r.start, r.stop) for r in pp_layer_ranges(layers, stages)]
    assert [stage_layers(layers, stages, s) for s in range(stages)] == planned
    with pytest.raises(ValueError, match="--pipeline-parallel-size 3 exceeds the model's 2 layers"):
        stage_layers(2, 3, 0)


def test_the_parallel_sizes_set_the_world() -> None:
    assert ParallelConfig.of(tensor_parallel_size=2).world_size == 2
    assert ParallelConfig.of(tensor_parallel_size=2, pipeline_parallel_size=2).world_size == 4
    assert ParallelConfig.of(world_size=3).world_size == 3  # replicas


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=4, tensor_parallel_size=2), "the world is their product, 2 ranks"),
    (dict(pipeline_parallel_size=0), "--pipeline-parallel-size must be >= 1"),
    (dict(enable_expert_parallel=True), "--enable-expert-parallel .* needs --tensor-parallel-size of at least 2"),
    (dict(tensor_parallel_size=2, nnodes=3), "--nnodes 3 does not divide the 2 ranks"),
    (dict(tensor_parallel_size=2, nnodes=2), "several nodes need --master-port"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=29500), "--node-rank 2 is not one of the 2 nodes"),
])
def test_configs_that_cannot_run_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs) if "world_size" in kwargs else ParallelConfig.of(**kwargs)
