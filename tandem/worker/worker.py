"""A rank: loads its model, sizes and owns its KV cache, runs its model runner each step.

The engine core never touches weights or tensors. It asks each worker (through an executor,
in-process or one process per rank) to load the model and report what it found (context
length, KV blocks that fit the budget, the model's fingerprint), to allocate its KV cache for
the block count every rank can hold, then to execute each step's plain `SchedulerOutput`.
The worker also hosts the worker sides of the KV connectors, which move KV in and out of its
cache around the forward pass.
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
from tandem.config import DECODE_WEIGHT_FORMATS, DTYPES, EngineConfig, ModelConfig
from tandem.distributed.expert_parallel import ExpertParallel
from tandem.distributed.layout import RankLayout, stage_layers
from tandem.distributed.pipeline_parallel import PipelineStage
from tandem.distributed.tensor_parallel import SINGLE_RANK, TensorParallel
from tandem.kernels.attention_registry import attention_capabilities, make_attention_backend
from tandem.kernels.base import AttentionBackend
from tandem.kernels.dense_gemv import load_dense_gemv_kernel
from tandem.kernels.int8_rows import load_int8_rows_kernel
from tandem.kernels.layer_ops import LayerOpsKernel, load_layer_ops
from tandem.kernels.q4_gemm import load_q4_kernel
from tandem.kvcache.connector.base import KVCacheAccess, KVConnectorWorker
from tandem.kvcache.connector.factory import make_connector_worker
from tandem.layers.bounded_greedy import BoundedGreedyHead
from tandem.layers.fused_ops import attach_gpu_passes, attach_layer_ops
from tandem.layers.int8 import int8_available
from tandem.layers.linear import (
    SmallStepWeights,
    attach_small_step_weights,
    onednn_available,
    pack_weights_for_cpu,
    quantize_int8,
)
from tandem.loader.fingerprint import model_fingerprint
from tandem.loader.model_loader import (
    build_model,
    init_dummy_weights,
    load_weights,
    read_model_config,
)
from tandem.loader.resolve import default_cache_dir, resolve_model
from tandem.models.decode_stack import attach_decode_stack
from tandem.platform.profiling import step_breakdown
from tandem.spec.model_proposers import ModelProposerLoader, model_proposer_loader
from tandem.worker.model_runner import ModelRunner, kv_bytes_per_block, rank_kv_spec

logger = logging.getLogger(__name__)

# What an executor's collective_rpc may call on every rank.
RPC_METHODS = ("start_profile", "stop_profile")

# The share of a GPU the engine may use (vLLM's --gpu-memory-utilization default).
GPU_MEMORY_UTILIZATION = 0.9
_DEFAULT_KV_FRACTION = 0.25
_DEFAULT_KV_CAP = 4 << 30


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


def default_kv_cache_bytes(num_local_ranks: int = 1) -> int:
    """25% of the memory available now, at most 4 GiB, shared by the ranks on this host."""
    available = psutil.virtual_memory().available
    return int(min(available * _DEFAULT_KV_FRACTION, _DEFAULT_KV_CAP)) // max(1, num_local_ranks)


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
    layers: tuple[int, int] = (0, 0)  # [start, end) of the decoder layers it holds
    stage: int = 0
    tp_rank: int = 0


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1, tp_group: Any = None) -> None:
        """`tp_group`: the torch.distributed group of this rank's tensor-parallel peers (None:
        the default group, which is right while tensor parallelism spans the whole world)."""
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
        if parallel.splits_model and config.speculative.method in ("draft_model", "eagle3"):
            raise ValueError(f"speculative method {config.speculative.method!r} runs its model beside a whole "
                             "target on one rank; it does not yet work with --tensor-parallel-size or "
                             "--pipeline-parallel-size > 1")
        if parallel.splits_model and (config.kv_transfer.role != "both" or config.kv_tiers.enabled):
            raise ValueError(
                "--tensor-parallel-size or --pipeline-parallel-size > 1 does not yet work with --role "
                "prefill/decode or the KV tiers: each rank holds its own part of every block, and they "
                "move whole blocks"
            )
        load = config.load
        if load.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {load.dtype!r}")
        self.dtype = getattr(torch, load.dtype)
        self.device = rank_device(load.device, rank % max(1, parallel.ranks_per_node))
        self.runner: ModelRunner | None = None
        self.connector: KVConnectorWorker | None = None
        self.kv_shm_path: str | None = None
        self._model: torch.nn.Module | None = None
        self._proposer: ModelProposerLoader | None = None  # a draft model or EAGLE head, if any
        self._info: WorkerInfo | None = None
        self._profiler: Any = None

    # --- start-up -------------------------------------------------------------------
    def load_model(self) -> WorkerInfo:
        started = time.perf_counter()
        config, load = self.config, self.config.load
        if load.num_threads:
            torch.set_num_threads(load.num_threads)
        resolved = resolve_model(config.model, load.dtype, load.cache_dir)
        model_config = read_model_config(resolved.hf_dir)
        self.stage = self._pipeline_stage(model_config.num_hidden_layers)
        cache = config.cache
        self.kv_dtype = self._kv_dtype()
        block_bytes = kv_bytes_per_block(model_config, cache.block_size, self.kv_dtype, self.tp.size,
                                         self.stage.num_layers)
        if cache.kv_cache_memory_bytes:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._gpu_kv_budget(resolved.hf_dir)
        else:
            budget = default_kv_cache_bytes(min(self.world_size, config.parallel.ranks_per_node))
        self._proposer = model_proposer_loader(config, model_config, resolved.hf_dir, self.dtype)
        if self._proposer is not None:
            # The proposer's KV shares the block ids: one block costs both models' bytes.
            block_bytes += self._proposer.kv_bytes_per_block(cache.block_size)
        num_blocks = budget // block_bytes
        if num_blocks < 2:
            raise ValueError(
                f"--kv-cache-memory {budget} bytes holds {num_blocks} blocks of {block_bytes} bytes; need at least 2"
            )
        max_model_len = self._max_model_len(model_config, num_blocks * cache.block_size)
        backend = make_attention_backend(load.attention_backend, self._kernel_cache_dir(), self.device.type)
        self._backend = backend
        self._model = self._build_model(model_config, resolved.hf_dir, backend, max_model_len)
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
            layers=(self.stage.start_layer, self.stage.end_layer),
            stage=self.stage.index,
            tp_rank=self.tp.rank,
        )
        return self._info

    def _kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: the model's, or float8 e4m3 under --kv-cache-dtype fp8, which
        only the Triton kernels read (they widen each block as they load it) and which no
        connector moves yet (their layouts and stores assume the model's dtype)."""
        config = self.config
        choice = config.cache.kv_cache_dtype
        if choice == "auto":
            return self.dtype
        if choice != "fp8":
            raise ValueError(f"--kv-cache-dtype must be auto or fp8, not {choice!r}")
        if not attention_capabilities(config.load.attention_backend, self.device.type).fp8_kv_cache:
            raise ValueError("--kv-cache-dtype fp8 needs the Triton attention backend (a GPU, or "
                             "--attention-backend triton under TRITON_INTERPRET=1)")
        if (config.kv_transfer.role != "both" or config.kv_tiers.enabled or config.kv_transfer.shared_memory
                or config.speculative.method):
            raise ValueError("--kv-cache-dtype fp8 does not yet work with --role prefill/decode, the KV tiers, "
                             "a shared-memory KV cache or speculative decoding")
        return torch.float8_e4m3fn

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

    def _build_model(self, model_config: ModelConfig, hf_dir: Path, backend: AttentionBackend,
                     max_model_len: int) -> torch.nn.Module:
        """Build the model, fill its weights, then lay them out for the kernels that read them."""
        load = self.config.load
        if load.quantization not in ("none", "int8"):
            raise ValueError(f"--quantization must be none or int8, not {load.quantization!r}")
        if load.quantization == "int8" and not int8_available():
            raise ValueError("--quantization int8 needs PyTorch's integer GEMM (torch._int_mm)")
        if self.device.type == "cuda":
            return self._build_gpu_model(model_config, hf_dir, backend, max_model_len)
        self._check_weights_fit(hf_dir)
        if self.ep is not None and model_config.moe is None and self.rank == 0:
            logger.info("--enable-expert-parallel: %s has no experts; nothing to shard", model_config.architecture)
        model = build_model(model_config, backend, max_model_len, self.dtype, self.tp, self.stage, self.ep)
        if load.load_format == "dummy":
            init_dummy_weights(model, load.seed)
        else:
            load_weights(model, hf_dir)
        small_step = self._small_step_weights()
        q4_kernel = dense_kernel = None
        if small_step is not None:
            q4_kernel = load_q4_kernel(self._kernel_cache_dir()) if small_step.format == "int4" else None
            dense_kernel = load_dense_gemv_kernel(self._kernel_cache_dir()) if small_step.format == "float32" else None
            added = attach_small_step_weights(model, small_step, q4_kernel, dense_kernel)
            if self.rank == 0:
                what = ("plain fp32 rows kept beside the packed weights, read by the fp32 GEMV"
                        if small_step.format == "float32" else "small-step weight copy")
                logger.info("%s %s for steps of <= %d tokens (+%.0f MiB)", small_step.format, what,
                            small_step.max_tokens, added / (1 << 20))
        if load.quantization == "int8":
            quantized = quantize_int8(model, load_int8_rows_kernel(self._kernel_cache_dir()))
            if self.rank == 0:
                logger.info("--quantization int8: %d projections hold 8-bit weights for steps of more than %s tokens",
                            quantized, small_step.max_tokens if small_step is not None else 0)
        if load.pack_weights and pack_weights_for_cpu(model) and self.rank == 0:
            logger.info("linear weights packed for oneDNN")
        ops = load_layer_ops(self._kernel_cache_dir())
        if small_step is not None and small_step.format == "float32":
            self._attach_bounded_greedy(model, ops)
        if ops is not None:
            attach_layer_ops(model, ops)
        stacked = small_step is not None and attach_decode_stack(model, backend, self._kernel_cache_dir(),
                                                                  q4_kernel, ops, dense_kernel)
        if stacked and self.rank == 0:
            logger.info("decode stack: steps of <= %d decode tokens run every layer in one C call",
                        small_step.max_tokens)
        return model

    def _build_gpu_model(self, model_config: ModelConfig, hf_dir: Path, backend: AttentionBackend,
                         max_model_len: int) -> torch.nn.Module:
        """The model on this rank's GPU: built there in the run dtype (no fp32 copy on the host
        or the device), its weights copied in through pinned staging buffers. The CPU-only
        layouts (oneDNN packing, 8-bit and small-step copies, the C passes) are not made."""
        load = self.config.load
        if load.quantization != "none" or load.decode_weights != "none":
            raise ValueError("--quantization and --decode-weights are CPU kernels; on a GPU the model runs in "
                             f"--dtype ({load.dtype}); drop them or pass --device cpu")
        started = time.perf_counter()
        model = build_model(model_config, backend, max_model_len, self.dtype, self.tp, self.stage, self.ep,
                            device=self.device)
        if load.load_format == "dummy":
            init_dummy_weights(model, load.seed)
            staged = None
        else:
            staged = load_weights(model, hf_dir, device=self.device)
        if self._backend.capabilities.gpu_layer_passes:
            from tandem.kernels.gpu.rms_norm import TritonNorm
            from tandem.kernels.gpu.rotary import TritonRotary
            from tandem.kernels.gpu.silu_mul import TritonSiluMul

            # One kernel each for the norms, the rotation and silu-and-mul instead of 8, 7
            # and 2 torch ops: at batch 1 those small launches were a fifth of the step.
            attach_gpu_passes(model, TritonNorm(), TritonRotary(), TritonSiluMul())
        torch.cuda.synchronize(self.device)
        if self.rank == 0:
            seconds = time.perf_counter() - started
            moved = f", {staged / 1e9:.2f} GB through pinned staging at {staged / 1e9 / seconds:.2f} GB/s" if staged else ""
            logger.info("model on %s in %s: %.2f s%s", self.device, load.dtype, seconds, moved)
        return model

    def _gpu_kv_budget(self, hf_dir: Path) -> int:
        """KV bytes on a GPU, as vLLM sizes them: --gpu-memory-utilization's 90% of the device,
        less what is in use now, the weights and one step's activation peak (both from the
        memory plan, since the model is not built yet)."""
        from tandem.plan.errors import PlanError

        free, total = torch.cuda.mem_get_info(self.device)
        try:
            weights, activation = self._planned_bytes(hf_dir)
        except (PlanError, OSError, ValueError, KeyError, IndexError) as error:
            raise ValueError(f"cannot plan this model's memory on {self.device} ({error}); give the KV cache's "
                             "size with --kv-cache-memory") from error
        budget = int(free - (1 - GPU_MEMORY_UTILIZATION) * total) - weights - activation
        if budget <= 0:
            raise ValueError(f"{self.device} has {free / (1 << 30):.1f} GiB free; the weights ({weights / (1 << 30):.1f} "
                             f"GiB) and one step's activations ({activation / (1 << 30):.1f} GiB) leave no room for KV")
        return budget

    def _planned_bytes(self, hf_dir: Path) -> tuple[int, int]:
        """(weight bytes, activation peak bytes) of this rank, from `tandem.plan`."""
        import json

        from tandem.plan.activation import activation_peak_bytes
        from tandem.plan.model_config import read_shape
        from tandem.plan.sharding import Parallel, WeightFormat, stage_weight_bytes, stages

        parallel, scheduler = self.config.parallel, self.config.scheduler
        split = Parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.enable_expert_parallel)
        shape = read_shape(json.loads((hf_dir / "config.json").read_text()))
        assert self.stage is not None
        stage = stages(shape, split)[self.stage.index]
        weights = stage_weight_bytes(stage, split, WeightFormat(self.config.load.dtype))
        activation = activation_peak_bytes(shape, split, stage.layers, self.stage.is_last, self.config.load.dtype,
                                           scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
        return weights, activation

    def _attach_bounded_greedy(self, model: torch.nn.Module, ops: LayerOpsKernel | None) -> None:
        """--decode-weights float32 (exact fp32, faster kernels): greedy rows read a bf16 copy
        of the LM head and compute only the candidates' fp32 logits (layers/bounded_greedy.py)."""
        head = getattr(model, "lm_head", None)
        if head is None or head.shard.tp.split or not onednn_available():
            return
        dense = getattr(head, "small_dense", None)
        rows = dense.weight if dense is not None else head.weight
        if rows.dtype != torch.float32 or rows.dim() != 2 or rows.numel() == 0:
            return
        head.bounded_greedy = BoundedGreedyHead(rows, ops)
        if self.rank == 0:
            logger.info("greedy rows read the LM head's bf16 copy and compute only their candidates' fp32 "
                        "logits (+%.0f MiB)", head.bounded_greedy.nbytes / (1 << 20))

    def _check_weights_fit(self, hf_dir: Path) -> None:
        """Refuse, before allocating anything, a share of the model this host cannot hold:
        the memory plan's weight bytes for this rank against the memory available to each of
        this host's ranks (they load at once). A model too large gets a message saying how to
        split it, not an allocator's failure halfway through building it."""
        import json

        from tandem.plan.errors import PlanError
        from tandem.plan.model_config import read_shape
        from tandem.plan.sharding import Parallel, WeightFormat, stage_weight_bytes, stages

        parallel = self.config.parallel
        split = Parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.enable_expert_parallel)
        try:
            shape = read_shape(json.loads((hf_dir / "config.json").read_text()))
            assert self.stage is not None
            need = stage_weight_bytes(stages(shape, split)[self.stage.index], split, WeightFormat(self.config.load.dtype))
        except (PlanError, OSError, ValueError, KeyError, IndexError):
            return  # the plan cannot say; building the model will
        local_ranks = min(self.world_size, parallel.ranks_per_node)
        available = psutil.virtual_memory().available // local_ranks
        if need > available:
            raise ValueError(
                f"rank {self.rank} would hold {need / (1 << 30):.1f} GiB of {self.config.load.dtype} weights, but "
                f"this host has {available / (1 << 30):.1f} GiB available per rank; split the model over more "
                "ranks or hosts (--tensor-parallel-size, --pipeline-parallel-size, --enable-expert-parallel, "
                f"--nnodes) or use a smaller --dtype; `tandem plan memory {hf_dir} --devices ...` shows the splits"
            )

    def _kernel_cache_dir(self) -> Path:
        """Where compiled C kernels are kept (under the model cache)."""
        cache_dir = self.config.load.cache_dir
        return Path(cache_dir) if cache_dir else default_cache_dir()

    def _small_step_weights(self) -> SmallStepWeights | None:
        load = self.config.load
        choice = load.decode_weights
        if choice == "none" or load.decode_weights_max_tokens < 1:
            return None
        if choice not in DECODE_WEIGHT_FORMATS:
            raise ValueError(f"decode weights must be none or one of {', '.join(DECODE_WEIGHT_FORMATS)}, not {choice!r}")
        if choice == "float32" and load.dtype != "float32":
            raise ValueError(f"--decode-weights float32 keeps an fp32 model's own rows; this model runs in {load.dtype} "
                             "(its compact copies are float16, bfloat16 or int4)")
        # The target's int4 copies only where they lose nothing (the checkpoint's own 4-bit
        # matrices); a draft model's guesses take any (tandem/spec/model_proposers.py).
        return SmallStepWeights(load.decode_weights_max_tokens, choice,
                                int4_max_error=TARGET_INT4_MAX_ERROR if choice == "int4" else None)

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
                                  tp=self.tp, stage=self.stage, device=self.device, kv_dtype=self.kv_dtype)
        if self._proposer is not None:
            self.runner.drafter = self._proposer.proposer(num_blocks, config.cache.block_size)
        if self.device.type == "cuda" and not config.load.enforce_eager:  # after the drafter: it keeps steps eager
            self.runner.capture_decode_graphs(config.load.max_cudagraph_batch, self._info.max_model_len)
        self.connector = make_connector_worker(config, self.rank)
        if self.connector is None:
            return {}
        from tandem.kvcache.transfer.base import KVLayout

        model = self._model_config
        spec = rank_kv_spec(model, self.tp)  # what this rank's cache holds, and moves
        assert self.stage is not None
        layout = KVLayout(self.stage.num_layers, spec.num_heads, config.cache.block_size,
                          spec.head_dim, str(self.kv_dtype).removeprefix("torch."), spec.num_planes)
        access = KVCacheAccess(self.runner.read_blocks, self.runner.write_blocks, layout, num_blocks,
                               self.rank, self.world_size, self.kv_shm_path, self._info.fingerprint)
        return self.connector.register_kv_cache(access)

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


# --decode-weights int4: the largest relative error of a matrix's 4-bit copy (else it gets an
# 8-bit one, or keeps its dense weights where that too is further). A Q4 GGUF's 4-bit tensors
# come back within fp16 rounding (< 1e-3); its 8-bit embedding / LM head would lose ~9% in 4
# bits (SmolLM2-135M: +6.9% perplexity), and an 8-bit copy holds it.
TARGET_INT4_MAX_ERROR = 0.01


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's weights take: parameters, their oneDNN-packed layouts and their
    small-step copies (each storage once: a tied head is the embedding)."""
    seen: set[int] = set()
    total = 0
    tensors: list[torch.Tensor] = list(model.parameters())
    for module in model.modules():
        for name in ("packed_weight", "small_weight", "small_bias", "small_packed"):
            extra = getattr(module, name, None)
            if isinstance(extra, torch.Tensor):
                tensors.append(extra)
        dense = getattr(module, "small_dense", None)  # --decode-weights float32: the plain rows kept
        if dense is not None:
            tensors.append(dense.weight)
        for compact in (getattr(module, "small_quantized", None), getattr(module, "int8", None),
                        getattr(module, "bounded_greedy", None)):
            if compact is not None:
                total += compact.nbytes
        tensors += list(getattr(module, "packed_halves", None) or ())
    for tensor in tensors:
        if tensor.is_mkldnn:
            total += tensor.element_size() * tensor.numel()
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


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
