"""A rank: loads its model, sizes and owns its KV cache, runs its model runner each step.

The engine core never touches weights or tensors. It asks each worker (through an executor,
in-process or one process per rank) to load the model and report what it found (context
length, KV blocks that fit the budget, the model's fingerprint), to allocate its KV cache for
the block count every rank can hold, then to execute each step's plain `SchedulerOutput`.
The worker also hosts the worker sides of the KV connectors, which move KV in and out of its
cache around the forward pass.

The worker keeps the lifecycle; building the model is model_builder.py's, sizing the KV cache
kv_sizing.py's, and refusing settings that cannot work together tandem/config_checks.py's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from tandem.batch.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tandem.config import EngineConfig, ModelConfig
from tandem.config_checks import check_engine_config
from tandem.distributed.expert_parallel import ExpertParallel
from tandem.distributed.layout import RankLayout, stage_layers
from tandem.distributed.pipeline_parallel import PipelineStage
from tandem.distributed.tensor_parallel import SINGLE_RANK, TensorParallel
from tandem.kernels.attention_registry import make_attention_backend
from tandem.kvcache.connector.base import KVCacheAccess, KVConnectorWorker
from tandem.kvcache.connector.factory import make_connector_worker
from tandem.loader.fingerprint import model_fingerprint
from tandem.loader.model_loader import read_model_config
from tandem.loader.resolve import default_cache_dir, resolve_model
from tandem.platform.allocator import MallocThresholds, keep_freed_memory
from tandem.platform.collector import freeze_start_up_objects
from tandem.platform.profiling import step_breakdown
from tandem.spec.model_proposers import ModelProposerLoader, model_proposer_loader
from tandem.worker.kv_scales import CALIBRATION_TEXT, FP8_QUALITY, calibrate_kv_scales, describe
from tandem.worker.kv_sizing import kv_blocks, kv_budget_bytes
from tandem.worker.model_builder import ModelBuilder, model_bytes
from tandem.worker.model_runner import ModelRunner, kv_bytes_per_block, rank_kv_spec
from tandem.worker.step_reads import StepReads, step_reads

logger = logging.getLogger(__name__)

# What an executor's collective_rpc may call on every rank.
RPC_METHODS = ("start_profile", "stop_profile")


def rank_device(choice: str, local_rank: int) -> torch.device:
    """The device a rank runs on: the CPU, or the GPU of its place on this host."""
    if choice != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch sees no GPU (a CPU build of torch, or no driver); "
                         "use --device cpu")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"rank {local_rank} of this host needs GPU {local_rank}, but only "
                         f"{torch.cuda.device_count()} are visible")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker found when it loaded the model; the engine core sizes itself from it."""

    rank: int
    model_name: str
    hf_dir: str
    fingerprint: str
    model_config: ModelConfig
    eos_token_ids: tuple[int, ...]
    num_blocks: int  # blocks that fit this rank's KV budget
    block_bytes: int
    max_model_len: int
    attention_backend: str
    load_seconds: float
    weight_bytes: int = 0  # what this rank's weights take in memory, packed copies included
    step_reads: StepReads | None = None  # what its steps read, by size (the bench's own limits)
    layers: tuple[int, int] = (0, 0)  # [start, end) of the decoder layers it holds
    stage: int = 0
    tp_rank: int = 0


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1, tp_group: Any = None,
                 owns_process: bool = False) -> None:
        """`tp_group`: the torch.distributed group of this rank's tensor-parallel peers (None:
        the default group, which is right while tensor parallelism spans the whole world).
        `owns_process`: the process is one tandem started for this worker or its engine core,
        so the worker freezes the cycle collector's start-up objects (platform/collector.py);
        in a caller's process (`tandem.LLM`) a freeze could keep the caller's garbage for good."""
        self.config = config
        self.rank = rank
        self.world_size = world_size
        parallel = config.parallel
        self.layout = RankLayout(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        tp_size = parallel.tensor_parallel_size
        # This rank's share of every layer.
        self.tp = TensorParallel(self.layout.tp_rank(rank), tp_size, tp_group) if tp_size > 1 else SINGLE_RANK
        self.stage: PipelineStage | None = None  # known once the model's layer count is
        # MoE layers: whole experts, a share per rank of the tensor-parallel group.
        self.ep = ExpertParallel(self.tp.rank, self.tp.size, tp_group) if parallel.enable_expert_parallel else None
        # Settings that cannot work together; the flag parser has refused them already, but an
        # engine may be built another way (tandem.LLM, a headless rank).
        check_engine_config(config)
        load = config.load
        self.dtype = getattr(torch, load.dtype)
        self.device = rank_device(load.device, rank % max(1, parallel.ranks_per_node))
        self.runner: ModelRunner | None = None
        self.connector: KVConnectorWorker | None = None
        self.kv_shm_path: str | None = None
        self._model: torch.nn.Module | None = None
        self._proposer: ModelProposerLoader | None = None  # a draft model or EAGLE head, if any
        self._info: WorkerInfo | None = None
        self._profiler: Any = None
        self.owns_process = owns_process

    # --- start-up -------------------------------------------------------------------
    def load_model(self) -> WorkerInfo:
        started = time.perf_counter()
        config, load = self.config, self.config.load
        if load.num_threads:
            torch.set_num_threads(load.num_threads)
        if self.owns_process:
            freeze_start_up_objects()  # the imports: no collection walks them while the model is built
        if self.device.type == "cpu" and keep_freed_memory() and self.rank == 0:
            logger.info("malloc keeps freed blocks up to %d MiB in the process (activations reused, not refaulted)",
                        MallocThresholds().mmap >> 20)
        resolved = resolve_model(config.model, load.dtype, load.cache_dir)
        model_config = read_model_config(resolved.hf_dir)
        self.stage = self._pipeline_stage(model_config.num_hidden_layers)
        cache = config.cache
        self.kv_dtype = self._kv_dtype()
        block_bytes = kv_bytes_per_block(model_config, cache.block_size, self.kv_dtype, self.tp.size,
                                         self.stage.num_layers)
        budget = kv_budget_bytes(config, self.device, resolved.hf_dir, self.stage, self.world_size)
        self._proposer = model_proposer_loader(config, model_config, resolved.hf_dir, self.dtype)
        if self._proposer is not None:
            # The proposer's KV shares the block ids: one block costs both models' bytes.
            block_bytes += self._proposer.kv_bytes_per_block(cache.block_size)
        num_blocks = kv_blocks(budget, block_bytes)
        max_model_len = self._max_model_len(model_config, num_blocks * cache.block_size)
        backend = make_attention_backend(load.attention_backend, self._kernel_cache_dir(), self.device.type)
        self._backend = backend
        builder = ModelBuilder(config, self.rank, self.device, self.dtype, self.tp, self.stage, self.ep,
                               self.world_size, self._kernel_cache_dir())
        self._model = builder.build(model_config, resolved.hf_dir, backend, max_model_len)
        self._model_config = model_config
        if self._proposer is not None:
            self._proposer.load(backend, max_model_len, self._model, self._kernel_cache_dir())
        self._info = WorkerInfo(
            rank=self.rank,
            model_name=resolved.name,
            hf_dir=str(resolved.hf_dir),
            fingerprint=model_fingerprint(model_config.architecture, load.dtype, resolved.source,
                                          load.load_format, load.seed),
            model_config=model_config,
            eos_token_ids=_eos_token_ids(model_config, resolved.hf_dir),
            num_blocks=num_blocks,
            block_bytes=block_bytes,
            max_model_len=max_model_len,
            attention_backend=backend.name,
            load_seconds=time.perf_counter() - started,
            weight_bytes=model_bytes(self._model),
            step_reads=step_reads(self._model),
            layers=(self.stage.start_layer, self.stage.end_layer),
            stage=self.stage.index,
            tp_rank=self.tp.rank,
        )
        return self._info

    def _kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: the model's, bf16 under --kv-cache-dtype bfloat16 (an fp32
        model's cache at half the bytes), float8 e4m3 under fp8, or uint8 rows of int8 values and
        their scale under int8 (tandem/kernels/kv_format.py; which settings each works with is
        checked with the config, tandem/config_checks.py)."""
        choice = self.config.cache.kv_cache_dtype
        if choice == "auto":
            return self.dtype
        return {"bfloat16": torch.bfloat16, "int8": torch.uint8}.get(choice, torch.float8_e4m3fn)

    def _pipeline_stage(self, num_layers: int) -> PipelineStage:
        """This rank's stage: its layers, and the peers it receives from and sends to."""
        layout = self.layout
        rank = self.rank % layout.world_size  # replicas (--world-size alone) each hold every layer
        stages = layout.pipeline_parallel_size
        index = layout.stage(rank)
        start, end = stage_layers(num_layers, stages, index)
        return PipelineStage(index, stages, start, end,
                             prev_rank=layout.peer(rank, index - 1) if index > 0 else None,
                             next_rank=layout.peer(rank, index + 1) if index < stages - 1 else None)

    def _kernel_cache_dir(self) -> Path:
        """Where compiled C kernels are kept (under the model cache)."""
        cache_dir = self.config.load.cache_dir
        return Path(cache_dir) if cache_dir else default_cache_dir()

    def _max_model_len(self, model_config: ModelConfig, kv_tokens: int) -> int:
        limits = [model_config.max_position_embeddings, kv_tokens]
        if model_config.sliding_window:
            limits.append(model_config.sliding_window)
        wanted = self.config.scheduler.max_model_len
        if wanted:
            if wanted > model_config.max_position_embeddings:
                raise ValueError(
                    f"max_model_len {wanted} exceeds the model's {model_config.max_position_embeddings} positions"
                )
            limits.append(wanted)
        return min(limits)

    def initialize_cache(self, num_blocks: int) -> dict[str, Any]:
        """Allocate the KV cache for `num_blocks` and start the connectors' worker sides;
        returns what the connectors' scheduler sides need to know (addresses, layout)."""
        assert self._model is not None and self._info is not None, "load_model first"
        config = self.config
        if config.kv_transfer.shared_memory and self.rank == 0 and self.device.type == "cpu":
            remove_orphaned_kv_files()
            self.kv_shm_path = f"/dev/shm/tandem-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.runner = ModelRunner(self._model, self._model_config, self._backend, num_blocks,
                                  config.cache.block_size, self.dtype, config.load.seed, kv_shm_path=self.kv_shm_path,
                                  tp=self.tp, stage=self.stage, device=self.device, kv_dtype=self.kv_dtype,
                                  commit_kv=not config.cache.lazy_kv_cache, run_ahead=config.runs_ahead)
        if self._proposer is not None:
            self.runner.drafter = self._proposer.proposer(num_blocks, config.cache.block_size)
        if self.kv_dtype == torch.float8_e4m3fn:  # before CUDA graphs: they keep the scales they saw
            if self.rank == 0:
                logger.warning(FP8_QUALITY)
            self._calibrate_fp8_scales(num_blocks)
        if self.device.type == "cuda" and not config.load.enforce_eager:  # after the drafter: it keeps steps eager
            self.runner.capture_decode_graphs(config.load.max_cudagraph_batch, self._info.max_model_len)
        self.connector = make_connector_worker(config, self.rank)
        if self.owns_process:  # the model, the runner and its graphs: no collection walks them while serving
            frozen = freeze_start_up_objects(collect=True)
            logger.debug("rank %d: %d start-up objects frozen out of the cycle collector's walks", self.rank, frozen)
        if self.connector is None:
            return {}
        from tandem.kvcache.transfer.base import KVLayout

        model = self._model_config
        spec = rank_kv_spec(model, self.tp)  # what this rank's cache holds, and moves
        assert self.stage is not None
        layout = KVLayout(self.stage.num_layers, spec.num_heads, config.cache.block_size,
                          spec.head_dim, str(self.kv_dtype).removeprefix("torch."), spec.num_planes,
                          self._model.key_divisors, self.runner.kv_scales())
        access = KVCacheAccess(self.runner.read_blocks, self.runner.write_blocks, layout, num_blocks,
                               self.rank, self.world_size, self.kv_shm_path, self._info.fingerprint)
        return self.connector.register_kv_cache(access)

    def _calibrate_fp8_scales(self, num_blocks: int) -> None:
        """Each attention layer's key and value scales for the fp8 cache (worker/kv_scales.py),
        from the built-in text; 1.0 where they cannot be measured, said in the log."""
        assert self.stage is not None and self._info is not None
        if self.stage.split:
            logger.info("fp8 KV cache: scales 1.0 (a pipeline stage cannot run the calibration text alone)")
            return
        from tandem.loader.tokenizer import load_tokenizer

        try:
            token_ids = load_tokenizer(Path(self._info.hf_dir)).encode(CALIBRATION_TEXT)
        except FileNotFoundError as error:
            logger.warning("fp8 KV cache: scales 1.0 (no tokenizer for the calibration text: %s)", error)
            return
        block_size = self.config.cache.block_size
        token_ids = token_ids[: min(num_blocks, self._info.max_model_len // block_size) * block_size]
        started = time.perf_counter()
        scales = calibrate_kv_scales(self.runner.model, self.runner.kv_caches, block_size, self.device, token_ids)
        if scales:
            logger.info("fp8 KV cache: per-layer scales from %d tokens of built-in text in %.1f s: %s",
                        len(token_ids), time.perf_counter() - started, describe(scales))

    def weights_checksum(self) -> float:
        """A cheap digest of the loaded weights, for the ranks of a stage to confirm they hold
        the same model: the norms, which every rank of a stage holds whole even when tensor
        parallelism splits the rest."""
        assert self._model is not None
        norms = [p for name, p in self._model.named_parameters() if "norm" in name][:4]
        return float(sum(p.detach().float().abs().sum() for p in norms))

    # --- steps ----------------------------------------------------------------------
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "initialize_cache first"
        connector = self.connector
        if connector is not None:
            connector.start_load_kv(out.kv_connector_metadata)
            connector.wait_for_load()
        result = self.runner.execute_model(out)
        if connector is not None:
            connector.save_kv(out.kv_connector_metadata)
            connector.wait_for_save()
            result.kv_connector_output = connector.get_finished()
        return result

    # --- profiling (tandem bench offline --profile) -------------------------------------
    def start_profile(self) -> None:
        """Record the named phases of every step from now on (tandem/platform/profiling.py)."""
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._profiler.start()

    def stop_profile(self) -> dict[str, float]:
        """Milliseconds per phase since `start_profile`, the step time they partition."""
        self._profiler.stop()
        breakdown = step_breakdown(self._profiler.events())
        self._profiler = None
        return breakdown

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
            self.connector = None
        if self.kv_shm_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.kv_shm_path)
            self.kv_shm_path = None


def _eos_token_ids(model_config: ModelConfig, hf_dir: Path) -> tuple[int, ...]:
    """The config's end-of-sequence ids plus the tokenizer's, when the directory has one."""
    ids = set(model_config.eos_token_ids)
    if any((hf_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        from tandem.loader.tokenizer import load_tokenizer

        eos = load_tokenizer(hf_dir).eos_token_id
        if eos is not None:
            ids.add(int(eos))
    return tuple(sorted(ids))


_SHM_KV_FILE = re.compile(r"tandem-kv-(\d+)-[0-9a-f]{8}")


def remove_orphaned_kv_files(directory: str = "/dev/shm") -> list[str]:
    """Delete the shared-memory KV caches (`tandem-kv-<pid>-<hex>`, this module's own names)
    whose worker process is gone: a worker killed with SIGKILL cannot remove its own, and each
    holds a whole KV budget of memory. A live pid's file is left alone, whoever owns it."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = _SHM_KV_FILE.fullmatch(name)
        if match is None or psutil.pid_exists(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path, follow_symlinks=False).st_uid == os.getuid():
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
    if removed:
        logger.info("removed %d shared-memory KV cache file(s) left by workers that died: %s", len(removed),
                    ", ".join(removed))
    return removed
