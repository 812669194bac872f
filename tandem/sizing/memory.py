"""The memory plan: what each rank holds, and how many KV tokens fit beside it.

Per rank of each pipeline stage:

    weights     the rank's shard of the weights (sharding.py)
    activation  the peak of one forward pass at max_num_batched_tokens (activation.py)
    reserved    CUDA context + NCCL on a GPU (devices.py), nothing on a CPU
    KV left     what remains for the KV cache under the engine's policy, below
    KV tokens   KV left / KV bytes per token (kv.py), in whole 16-token blocks

tandem's policy (`--memory-utilization`, default 0.92) caps what the engine keeps for the model
state, weights + KV cache, at that fraction of the device, the convention of SGLang's
`mem_fraction_static`; the activation peak, the CUDA context and NCCL must fit in the rest.
If they do not, the KV cache gives way:

    KV left = min(u x memory, memory - activation - reserved) - weights

vLLM's policy (`gpu_memory_utilization`, default 0.9) caps everything the engine allocates,
activation peak and non-torch memory included, at that fraction, and it profiles the peak at
its own defaults (8192 batched tokens and 1024 sequences on GPUs of 70 GiB or more, 2048 and
256 below; `EngineArgs.get_batch_defaults` in vllm/engine/arg_utils.py):

    KV left = 0.9 x memory - weights - activation - reserved

The plan prints both, with the same weights and the same activation formula, so the
difference is the policies and the defaults, not the estimates, and what each engine loads:
tandem serves a multimodal checkpoint's text decoder only, vLLM builds Kimi K2.5's vision tower
and projector on every rank too (counted whole in its column, `StagePlan.vision_bytes`).

The KV tokens of the deployment are the fewest any stage holds (every stage caches every
token of its own layers; tensor-parallel ranks of a stage hold the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.sizing.activation import activation_peak_bytes
from tandem.sizing.devices import Devices, GiB
from tandem.sizing.errors import PlanError
from tandem.sizing.kv import kv_bytes_per_token
from tandem.sizing.shape import DTYPE_BYTES, ModelShape, read_shape
from tandem.sizing.sharding import (
    Parallel,
    Stage,
    WeightFormat,
    quantized_parts,
    stage_weight_bytes,
    stages,
    validate,
)
from tandem.sizing.tensors import ParamCounts, count_params

DEFAULT_MEMORY_UTILIZATION = 0.92
VLLM_MEMORY_UTILIZATION = 0.9
BLOCK_SIZE = 16
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32", "fp8")
KV_DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32", "fp8", "int8")


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for: devices, parallelism, dtypes and the scheduler's limits."""

    devices: Devices
    parallel: Parallel = Parallel()
    dtype: str = "auto"  # auto: the checkpoint's (FP8 blocks if it ships them)
    kv_cache_dtype: str = "auto"  # auto: the activation dtype
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION
    # An explicit dtype still keeps a compressed-tensors checkpoint's packed matmuls packed, as
    # the engine holds them (Kimi K2.5's INT4 experts); False: plan it unquantised (`--dtype`).
    keep_packed: bool = False


@dataclass(frozen=True)
class StagePlan:
    """One kind of rank: the ranks of one pipeline stage."""

    label: str
    ranks: int
    first_layer: int
    last_layer: int
    device_bytes: int
    budget_bytes: int  # memory_utilization x device
    weight_bytes: int  # vision_bytes included
    activation_bytes: int
    reserved_bytes: int
    kv_bytes: int  # negative: the weights do not fit
    kv_bytes_per_token: int
    kv_tokens: int
    vision_bytes: int = 0  # a vision tower + projector this engine loads on the rank


@dataclass(frozen=True)
class EnginePlan:
    """The stages under one engine's memory policy (tandem's, or vLLM's defaults)."""

    engine: str
    memory_utilization: float
    max_num_batched_tokens: int
    max_num_seqs: int
    stages: tuple[StagePlan, ...]

    @property
    def fits(self) -> bool:
        return all(stage.kv_tokens > 0 for stage in self.stages)

    @property
    def kv_tokens(self) -> int:
        return min(stage.kv_tokens for stage in self.stages)

    @property
    def kv_bytes_total(self) -> int:
        return sum(max(stage.kv_bytes, 0) * stage.ranks for stage in self.stages)

    def max_sequences(self, max_model_len: int) -> int:
        return self.kv_tokens // max_model_len


@dataclass(frozen=True)
class MemoryPlan:
    """The whole plan: the model, where it runs, tandem's split and vLLM's beside it."""

    model: str
    architecture: str
    params: ParamCounts
    weights: str
    kv_cache_dtype: str
    devices: Devices
    parallel: Parallel
    max_model_len: int
    tandem: EnginePlan
    vllm: EnginePlan | None  # None on CPU devices
    notes: tuple[str, ...]


def weight_format(shape: ModelShape, dtype: str, keep_packed: bool = False) -> WeightFormat:
    """The weights' storage: the checkpoint's for 'auto', else the --dtype asked for (with the
    checkpoint's packed integer matmuls kept where `keep_packed`, as the engine runs them)."""
    if dtype not in DTYPE_CHOICES:
        raise PlanError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    if dtype == "auto":
        return WeightFormat(shape.dtype, shape.fp8_block, shape.int_quant)
    if dtype == "fp8":
        act = shape.dtype if shape.dtype != "float32" else "bfloat16"
        return WeightFormat(act, shape.fp8_block or (128, 128))
    return WeightFormat(dtype, int_quant=shape.int_quant if keep_packed else None)


def kv_dtype(fmt: WeightFormat, requested: str) -> str:
    if requested not in KV_DTYPE_CHOICES:
        raise PlanError(f"--kv-cache-dtype {requested!r}: choose one of {', '.join(KV_DTYPE_CHOICES)}")
    return fmt.dtype if requested == "auto" else requested


def vllm_batch_defaults(devices: Devices) -> tuple[int, int]:
    """`vllm serve`'s max_num_batched_tokens and max_num_seqs for these devices."""
    big = devices.kind.memory_bytes >= 70 * GiB
    return (8192, 1024) if big else (2048, 256)


def plan_memory(config: dict, request: PlanRequest, name: str = "") -> MemoryPlan:
    """The memory plan of the HF `config` on `request.devices`; `PlanError` if it cannot run."""
    shape = read_shape(config, name)
    parallel = request.parallel
    if request.devices.count != parallel.world_size:
        raise PlanError(f"{request.devices} is {request.devices.count} device(s), but tp {parallel.tp} x "
                        f"pp {parallel.pp} = {parallel.world_size} ranks (one rank per device)")
    if not 0 < request.memory_utilization <= 1:
        raise PlanError("--memory-utilization must be in (0, 1]")
    for flag, value in (("--max-num-batched-tokens", request.max_num_batched_tokens),
                        ("--max-num-seqs", request.max_num_seqs)):
        if value < 1:
            raise PlanError(f"{flag} must be at least 1")
    fmt = weight_format(shape, request.dtype, request.keep_packed)
    kv = kv_dtype(fmt, request.kv_cache_dtype)
    validate(shape, parallel, fmt)
    max_model_len = request.max_model_len or shape.max_position_embeddings
    if max_model_len < 1:
        raise PlanError("--max-model-len must be at least 1")
    pipeline = stages(shape, parallel)
    tandem = _engine_plan("tandem", shape, pipeline, request, fmt, kv, request.memory_utilization,
                          request.max_num_batched_tokens, request.max_num_seqs, activation_in_budget=False)
    vllm = None
    if request.devices.kind.gpu and kv != "int8":  # vLLM has no int8 KV cache to set beside it
        tokens, seqs = vllm_batch_defaults(request.devices)
        vllm = _engine_plan("vLLM", shape, pipeline, request, fmt, kv, VLLM_MEMORY_UTILIZATION,
                            tokens, seqs, activation_in_budget=True, vision_bytes=vision_weight_bytes(shape, fmt))
    if not tandem.fits:
        raise PlanError(_no_fit_message(tandem, request, fmt.fp8_block or fmt.int_quant))
    return MemoryPlan(
        model=shape.name or shape.architecture, architecture=shape.architecture,
        params=count_params(shape), weights=describe_weights(shape, fmt), kv_cache_dtype=kv,
        devices=request.devices, parallel=parallel, max_model_len=max_model_len,
        tandem=tandem, vllm=vllm, notes=_notes(shape, fmt, tandem, vllm, max_model_len, kv, request.devices.kind.gpu))


def describe_weights(shape: ModelShape, fmt: WeightFormat) -> str:
    """The weight format, and for packed integers which components the rules quantize."""
    if fmt.int_quant is None:
        return str(fmt)
    parts = quantized_parts(shape, fmt)
    return (f"compressed-tensors pack-quantized {fmt.int_quant} for {', '.join(parts) or 'no tensor'}; "
            f"rest {fmt.dtype}")


def vision_weight_bytes(shape: ModelShape, fmt: WeightFormat) -> int:
    """Bytes of the vision tower + projector on each vLLM rank: whole, in the activation dtype
    (vLLM builds Kimi K2.5's without the quantization config), 0 where it is not counted."""
    vision = shape.vision
    return vision.params * DTYPE_BYTES[fmt.dtype] if vision is not None and vision.loaded_by_vllm else 0


def kv_left_bytes(memory: int, utilization: float, weights: int, activation: int, reserved: int) -> int:
    """tandem's policy: weights + KV cache within `utilization` of the device's `memory`, and
    the activation peak and what is `reserved` (CUDA context, NCCL, anything already in use)
    within the rest; the KV cache gives way where they do not fit. Negative: the weights do
    not fit. The plan calls it with the device's figures, a GPU rank at start with what it
    measures (worker/kv_sizing.py), so the two agree."""
    return min(int(utilization * memory), memory - activation - reserved) - weights


def _engine_plan(engine: str, shape: ModelShape, pipeline: list[Stage], request: PlanRequest,
                 fmt: WeightFormat, kv: str, utilization: float, tokens: int, seqs: int,
                 activation_in_budget: bool, vision_bytes: int = 0) -> EnginePlan:
    parallel, devices = request.parallel, request.devices
    memory = devices.kind.memory_bytes
    reserved = devices.reserved_bytes(parallel.world_size)
    plans = []
    for stage in pipeline:
        weights = stage_weight_bytes(stage, parallel, fmt) + vision_bytes
        activation = activation_peak_bytes(shape, parallel, stage.layers, stage.last, fmt.dtype,
                                           tokens, seqs)
        budget = int(utilization * memory)
        if activation_in_budget:
            kv_bytes = budget - weights - activation - reserved
        else:
            kv_bytes = kv_left_bytes(memory, utilization, weights, activation, reserved)
        per_token = kv_bytes_per_token(shape, parallel.tp, len(stage.layers), kv)
        block = per_token * BLOCK_SIZE
        kv_tokens = max(kv_bytes, 0) // block * BLOCK_SIZE
        plans.append(StagePlan(
            label=_stage_label(stage, parallel), ranks=parallel.tp,
            first_layer=stage.layers.start, last_layer=stage.layers.stop - 1,
            device_bytes=memory, budget_bytes=budget, weight_bytes=weights,
            activation_bytes=activation, reserved_bytes=reserved, kv_bytes=kv_bytes,
            kv_bytes_per_token=per_token, kv_tokens=kv_tokens, vision_bytes=vision_bytes))
    return EnginePlan(engine, utilization, tokens, seqs, tuple(plans))


def _stage_label(stage: Stage, parallel: Parallel) -> str:
    if parallel.pp == 1:
        return "every rank" if parallel.tp > 1 else "the rank"
    return f"stage {stage.index} (layers {stage.layers.start}-{stage.layers.stop - 1})"


def _no_fit_message(plan: EnginePlan, request: PlanRequest, quantized: object) -> str:
    worst = min(plan.stages, key=lambda s: s.kv_bytes)
    room = worst.weight_bytes + worst.kv_bytes  # what the policy leaves for weights + KV
    short = worst.kv_bytes_per_token * BLOCK_SIZE - worst.kv_bytes  # to hold one KV block
    where = "each rank" if request.parallel.pp == 1 else f"each rank of {worst.label}"
    hint = "more devices or a larger --tp/--pp would help"
    if not quantized:
        hint = "more devices, a larger --tp/--pp, or --dtype fp8 would help"
    return (f"the weights do not fit on {request.devices} ({request.parallel}): {where} holds "
            f"{_gib(worst.weight_bytes)} of weights, but --memory-utilization "
            f"{request.memory_utilization:g} of {_gib(worst.device_bytes)} leaves "
            f"{_gib(max(room, 0))} for weights and KV cache after {_gib(worst.activation_bytes)} of "
            f"activations and {_gib(worst.reserved_bytes)} reserved; short by {_gib(short)} per rank "
            f"({hint})")


def _notes(shape: ModelShape, fmt: WeightFormat, plan: EnginePlan, vllm: EnginePlan | None,
           max_model_len: int, kv: str, gpu: bool) -> tuple[str, ...]:
    notes = []
    if gpu and kv == "int8":
        notes.append("vLLM has no int8 KV cache: no vLLM column (its nearest is --kv-cache-dtype fp8, "
                     "the same bytes less the row scales)")
    vision = shape.vision
    if vision is not None and vision.loaded_by_vllm:
        loaded = vllm.stages[0].vision_bytes if vllm is not None else vision_weight_bytes(shape, fmt)
        notes.append(f"{vision.name}: {vision.params / 1e9:.2f}B parameters, {_gib(loaded)} in {fmt.dtype}, "
                     "not in tandem's weights (it serves the text decoder only); vLLM builds it on every "
                     "rank, counted whole in its column (as its recipe's --mm-encoder-tp-mode data; the "
                     "default mode shards the tower's matmuls over tp)")
    elif vision is not None:
        notes.append(f"vision tower: {vision.params / 1e9:.2f}B parameters, counted apart and not "
                     "in the weights (a text-only server does not load it)")
    if shape.mla is not None and plan.stages[0].ranks > 1:
        notes.append(f"MLA caches one {shape.mla.kv_lora_rank + shape.mla.qk_rope_head_dim}-value latent per "
                     "token and layer, whole on every tp rank (vLLM replicates it too): tp does not add KV "
                     "capacity")
    if shape.mtp_layers:
        notes.append(f"{shape.mtp_layers} multi-token-prediction layer(s) in the checkpoint, not loaded "
                     "(only speculative decoding would use them)")
    if shape.architecture == "Llama4ForConditionalGeneration":
        notes.append("Llama 4's chunked-attention layers are counted as full attention (an upper bound "
                     "on KV per token)")
    if plan.max_sequences(max_model_len) == 0:
        notes.append(f"one sequence of max-model-len {max_model_len:,} does not fit: the KV cache holds "
                     f"{plan.kv_tokens:,} tokens; pass --max-model-len {plan.kv_tokens} or less")
    return tuple(notes)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"
