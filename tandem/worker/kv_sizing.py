"""How much memory a rank gives its KV cache, and whether its share of the weights fits at all.

Decided before the model is built, so from the memory model (`tandem.sizing`: the rank's
weight bytes and one step's activation peak, read from config.json). The KV budget:

- `--kv-cache-memory` given: that.
- On a GPU, the memory plan's policy (`tandem.sizing.memory.kv_left_bytes`, the convention of
  SGLang's mem_fraction_static): the weights and the KV cache within --memory-utilization (92%)
  of the device, and one step's activation peak and what is in use now (the CUDA context,
  NCCL, other processes) within the rest. `tandem plan memory` prints the same figure.
- On the CPU: 25% of the memory available now, at most 4 GiB, shared by this host's ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import torch

from tandem.config import EngineConfig
from tandem.distributed.pipeline_parallel import PipelineStage
from tandem.sizing.activation import activation_peak_bytes
from tandem.sizing.errors import PlanError
from tandem.sizing.memory import kv_left_bytes
from tandem.sizing.shape import ModelShape, read_shape
from tandem.sizing.sharding import Parallel, WeightFormat, stage_weight_bytes, stages

_DEFAULT_KV_FRACTION = 0.25
_DEFAULT_KV_CAP = 4 << 30


def default_kv_cache_bytes(num_local_ranks: int = 1) -> int:
    """25% of the memory available now, at most 4 GiB, shared by the ranks on this host."""
    available = psutil.virtual_memory().available
    return int(min(available * _DEFAULT_KV_FRACTION, _DEFAULT_KV_CAP)) // max(1, num_local_ranks)


def kv_budget_bytes(config: EngineConfig, device: torch.device, hf_dir: Path, stage: PipelineStage,
                    world_size: int) -> int:
    """The bytes this rank's KV cache may take (the rules above)."""
    if config.cache.kv_cache_memory_bytes:
        return config.cache.kv_cache_memory_bytes
    if device.type == "cuda":
        return gpu_kv_budget(config, device, hf_dir, stage)
    return default_kv_cache_bytes(min(world_size, config.parallel.ranks_per_node))


def kv_blocks(budget: int, block_bytes: int) -> int:
    """The KV blocks `budget` holds; ValueError below the two a step needs."""
    num_blocks = budget // block_bytes
    if num_blocks < 2:
        raise ValueError(
            f"--kv-cache-memory {budget} bytes holds {num_blocks} blocks of {block_bytes} bytes; need at least 2"
        )
    return num_blocks


def gpu_kv_budget(config: EngineConfig, device: torch.device, hf_dir: Path, stage: PipelineStage) -> int:
    """KV bytes on a GPU under the plan's policy (module docstring), with the weights and the
    activation peak from the memory plan (the model is not built yet) and what is in use on
    the device measured now."""
    free, total = torch.cuda.mem_get_info(device)
    try:
        weights, activation = planned_bytes(config, hf_dir, stage)
    except (PlanError, OSError, ValueError, KeyError, IndexError) as error:
        raise ValueError(f"cannot plan this model's memory on {device} ({error}); give the KV cache's "
                         "size with --kv-cache-memory") from error
    return gpu_budget_from(free, total, weights, activation, config.cache.memory_utilization, str(device))


def gpu_budget_from(free: int, total: int, weights: int, activation: int, utilization: float, device: str) -> int:
    """The KV bytes of a device with `free` of `total` bytes free before this rank allocates;
    ValueError when the weights and one step's activations leave none."""
    budget = kv_left_bytes(total, utilization, weights, activation, total - free)
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(f"{device} has {free / gib:.1f} of {total / gib:.1f} GiB free; the weights "
                         f"({weights / gib:.1f} GiB) within --memory-utilization {utilization:g} of it and one "
                         f"step's activations ({activation / gib:.1f} GiB) beside them leave no room for KV")
    return budget


def _split(config: EngineConfig) -> Parallel:
    parallel = config.parallel
    return Parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.enable_expert_parallel)


def engine_weight_format(config: EngineConfig, shape: ModelShape) -> WeightFormat:
    """How this engine holds the weights: the run dtype, except the matmuls a
    compressed-tensors checkpoint ships packed (Kimi K2.5's INT4 experts), which stay packed
    (layers/int4_experts.py) and are sized as stored."""
    return WeightFormat(config.load.dtype, int_quant=shape.int_quant)


def planned_bytes(config: EngineConfig, hf_dir: Path, stage: PipelineStage) -> tuple[int, int]:
    """(weight bytes, activation peak bytes) of a rank of `stage`, from `tandem.sizing`."""
    scheduler, split = config.scheduler, _split(config)
    shape = read_shape(json.loads((hf_dir / "config.json").read_text()))
    planned = stages(shape, split)[stage.index]
    weights = stage_weight_bytes(planned, split, engine_weight_format(config, shape))
    activation = activation_peak_bytes(shape, split, planned.layers, stage.is_last, config.load.dtype,
                                       scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
    return weights, activation


def check_weights_fit(config: EngineConfig, hf_dir: Path, stage: PipelineStage, rank: int, world_size: int) -> None:
    """Refuse, before allocating anything, a share of the model this host cannot hold:
    the memory plan's weight bytes for this rank against the memory available to each of
    this host's ranks (they load at once). A model too large gets a message saying how to
    split it, not an allocator's failure halfway through building it."""
    parallel, split = config.parallel, _split(config)
    try:
        shape = read_shape(json.loads((hf_dir / "config.json").read_text()))
        need = stage_weight_bytes(stages(shape, split)[stage.index], split, engine_weight_format(config, shape))
    except (PlanError, OSError, ValueError, KeyError, IndexError):
        return  # the plan cannot say; building the model will
    local_ranks = min(world_size, parallel.ranks_per_node)
    available = psutil.virtual_memory().available // local_ranks
    if need > available:
        raise ValueError(
            f"rank {rank} would hold {need / (1 << 30):.1f} GiB of {config.load.dtype} weights, but "
            f"this host has {available / (1 << 30):.1f} GiB available per rank; split the model over more "
            "ranks or hosts (--tensor-parallel-size, --pipeline-parallel-size, --enable-expert-parallel, "
            f"--nnodes) or use a smaller --dtype; `tandem plan memory {hf_dir} --devices ...` shows the splits"
        )
