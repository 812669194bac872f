"""Choices the model builder makes per CPU."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig, ParallelConfig
from tandem.distributed.pipeline_parallel import PipelineStage
from tandem.distributed.tensor_parallel import TensorParallel
from tandem.loader.copy_pipeline import ReadShare
from tandem.worker.model_builder import ModelBuilder, bf16_rows_pay


@pytest.mark.parametrize(("choice", "dtype", "tiles", "keeps"), [
    ("bfloat16", torch.bfloat16, True, False),  # the tiles read the packed blocks faster
    ("bfloat16", torch.bfloat16, False, True),  # no tiles (none packed, no AMX, the OS refused them)
    ("bfloat16", torch.float32, True, True),  # an fp32 model's bf16 copy halves its bytes
    ("float32", torch.float32, True, True),
    ("int4", torch.bfloat16, True, True),
])
def test_a_bf16_model_keeps_its_plain_rows_only_where_they_beat_the_tiles(
        choice: str, dtype: torch.dtype, tiles: bool, keeps: bool) -> None:
    assert bf16_rows_pay(choice, dtype, tiles) is keeps


@pytest.mark.parametrize(("world_size", "nnodes", "rank", "expected"), [
    (1, 1, 0, None),  # one rank reads the files itself
    (2, 1, 1, ReadShare(1, 2)),  # all ranks on this host: they split one forward read
    (4, 2, 1, None),  # two hosts: each reads exactly its own ranks' bytes
])
def test_the_ranks_of_one_host_share_the_read(world_size: int, nnodes: int, rank: int,
                                               expected: ReadShare | None, tmp_path) -> None:
    parallel = ParallelConfig(world_size=world_size, tensor_parallel_size=world_size, nnodes=nnodes,
                              master_port=29500 if nnodes > 1 else 0)
    builder = ModelBuilder(EngineConfig("m", parallel=parallel), rank, torch.device("cpu"), torch.float32,
                           TensorParallel(rank, world_size), PipelineStage(0, 1, 0, 1), None, world_size, tmp_path)
    assert builder.read_share() == expected


def test_the_packed_int8_gemm_is_taken_wherever_it_has_a_path(tmp_path) -> None:
    """`--quantization int8` multiplies through tandem's packed GEMM wherever its library has a
    path (AMX's int8 tiles or VNNI), not only where VNNI is the fastest multiply: on an AMX
    CPU `torch._int_mm` repacked every call (decode-heavy ~1,000 against ~1,730 output tok/s)."""
    from tandem.kernels.int8_gemm import load_int8_gemm_kernel

    builder = ModelBuilder(EngineConfig("m"), 0, torch.device("cpu"), torch.bfloat16, TensorParallel(0, 1),
                           PipelineStage(0, 1, 0, 1), None, 1, tmp_path)
    loaded = load_int8_gemm_kernel(tmp_path / "probe")
    taken = builder._int8_gemm()
    assert (taken is not None) == (loaded is not None)
    if taken is not None:
        assert taken.isa == loaded.isa
