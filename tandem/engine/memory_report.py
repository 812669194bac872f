"""The memory split an engine logs at start: what each rank holds, beside `tandem plan memory`.

Per rank: its pipeline stage and layers, the bytes its weights take (measured on the rank:
parameters plus the packed layouts the CPU kernels read), its KV cache (blocks, tokens and
bytes per token of its layers), and the plan's figures for the same model and split (weights,
the activation peak of one step at --max-num-batched-tokens), so a user sees the arithmetic
of `tandem plan memory` hold on the running engine. Torch-free.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tandem.config import EngineConfig

GiB = 1 << 30


def _plan(config: EngineConfig, hf_dir: str) -> Any:
    """tandem's plan for this model and split on this host's memory, or None if it cannot say."""
    import psutil

    from tandem.sizing.devices import parse_devices
    from tandem.sizing.errors import PlanError
    from tandem.sizing.memory import PlanRequest, plan_memory
    from tandem.sizing.sharding import Parallel

    parallel = config.parallel
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    try:
        hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
        memory = psutil.virtual_memory().total // parallel.ranks_per_node
        request = PlanRequest(parse_devices(f"{tp * pp}xcpu:{memory}B"),
                              Parallel(tp, pp, parallel.enable_expert_parallel), dtype=config.load.dtype,
                              max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                              max_num_seqs=config.scheduler.max_num_seqs, keep_packed=True)
        return plan_memory(hf_config, request).tandem
    except (PlanError, OSError, ValueError, KeyError):
        return None


def memory_split_lines(config: EngineConfig, infos: list[Any], num_blocks: int) -> list[str]:
    """One line per rank of the model's split (replicas: rank 0 only)."""
    block_size = config.cache.block_size
    plan = _plan(config, infos[0].hf_dir)
    split = config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size
    lines = []
    for info in infos[:split]:
        planned = ""
        if plan is not None and info.stage < len(plan.stages):
            stage = plan.stages[info.stage]
            planned = (f"; planned: weights {stage.weight_bytes / GiB:.2f} GiB, "
                       f"activation peak {stage.activation_bytes / GiB:.2f} GiB")
        kv_bytes = num_blocks * info.block_bytes
        first, end = info.layers
        lines.append(
            f"rank {info.rank} (stage {info.stage}, layers {first}-{end - 1}, tp rank {info.tp_rank}): "
            f"weights {info.weight_bytes / GiB:.2f} GiB, KV {kv_bytes / GiB:.2f} GiB = {num_blocks} blocks "
            f"= {num_blocks * block_size} tokens at {info.block_bytes // block_size / 1024:.1f} KiB/token{planned}"
        )
    return lines


def log_memory_split(logger: logging.Logger, config: EngineConfig, infos: list[Any], num_blocks: int) -> None:
    for line in memory_split_lines(config, infos, num_blocks):
        logger.info("memory: %s", line)
