"""How the weights split over ranks (TP, PP, EP) and what each rank holds, in bytes.

Rules (vLLM's, which tandem will follow when it runs sharded):

- Tensor parallelism (tp): column-parallel weights (q/k/v, gate/up, MLA's q_b/kv_b) keep
  1/tp of their output rows, row-parallel ones (o_proj, down_proj) 1/tp of their input
  columns; the embedding and LM head keep 1/tp of the vocabulary; norms, the router and MLA's
  q_a/kv_a down-projections are replicated. KV heads split like query heads while there are
  at least tp of them; past that each rank keeps one (replicated), so tp must divide the KV
  heads or be a multiple of them.
- Pipeline parallelism (pp): layers split as vLLM's `get_pp_indices` does (equal parts, the
  remainder to the stages just before the last); the embedding lives on the first stage, the
  final norm and LM head on the last (a tied head is a separate copy there when pp > 1).
- Expert parallelism (`--ep`): the routed experts are dealt out whole over the tp ranks
  (num_experts / tp each); attention, dense MLPs and shared experts stay tensor-parallel.

Bytes: every tensor in the model dtype, except
- FP8 block-quantised checkpoints (DeepSeek-V3, Kimi-K2), where matmul weights are 1 byte per
  parameter plus one float32 scale per 128 x 128 block of each rank's slice; embeddings, LM
  head, norms and router stay in the model dtype, DeepSeek's router bias in float32;
- compressed-tensors pack-quantized checkpoints (Kimi K2.5), where each matmul weight its rules
  quantize is packed integers + a scale per group (+ packed zero points, group indices) + its
  shape, for each rank's slice (quant.py); the rest stays in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.sizing.errors import PlanError
from tandem.sizing.quant import CompressedTensors, IntScheme
from tandem.sizing.shape import DTYPE_BYTES, ModelShape
from tandem.sizing.tensors import (
    Part,
    Split,
    Tensor,
    embedding_tensors,
    head_tensors,
    layer_tensors,
    model_tensors,
)


@dataclass(frozen=True)
class Parallel:
    tp: int = 1
    pp: int = 1
    ep: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def ep_size(self) -> int:
        return self.tp if self.ep else 1

    def __str__(self) -> str:
        ep = f", experts over {self.tp} ranks (EP)" if self.ep else ""
        return f"tp {self.tp}, pp {self.pp}{ep}"


@dataclass(frozen=True)
class WeightFormat:
    """What the weights are stored in: a dtype, and optionally FP8 blocks for matmul weights
    or compressed-tensors packed integers for the matmul weights its rules name."""

    dtype: str  # float32 | bfloat16 | float16: everything not quantized, and the activations
    fp8_block: tuple[int, int] | None = None
    int_quant: CompressedTensors | None = None

    def __str__(self) -> str:
        if self.fp8_block:
            rows, cols = self.fp8_block
            return f"fp8 e4m3 ({rows}x{cols} blocks, fp32 scales; rest {self.dtype})"
        if self.int_quant:
            return f"compressed-tensors pack-quantized {self.int_quant}; rest {self.dtype}"
        return self.dtype


def int_scheme(t: Tensor, fmt: WeightFormat) -> IntScheme | None:
    """The packed-integer scheme `t` is stored in, None if it is in the model dtype: only
    nn.Linear weights (the matmuls and the LM head) that the checkpoint's rules quantize."""
    if fmt.int_quant is None or not t.module or not (t.linear or t.part is Part.LM_HEAD):
        return None
    return fmt.int_quant.scheme_for(t.module, t.experts)


def quantized_parts(shape: ModelShape, fmt: WeightFormat) -> list[str]:
    """The components (`Part` values) whose weights `fmt` stores as packed integers."""
    parts = {t.part.value for t in model_tensors(shape) if int_scheme(t, fmt)}
    return [part.value for part in Part if part.value in parts]


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: the layers it runs and every tensor it holds (whole, unsharded)."""

    index: int
    layers: range
    first: bool
    last: bool
    tensors: tuple[Tensor, ...]


def pp_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """vLLM's `get_pp_indices`: equal parts, the remainder to the stages before the last."""
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stages(shape: ModelShape, parallel: Parallel) -> list[Stage]:
    """The pipeline stages, each with the tensors it holds."""
    out = []
    for index, layers in enumerate(pp_layer_ranges(shape.num_layers, parallel.pp)):
        first, last = index == 0, index == parallel.pp - 1
        tensors: list[Tensor] = embedding_tensors(shape) if first else []
        for layer in layers:
            tensors += layer_tensors(shape, layer)
        if last:
            tensors += head_tensors(shape, separate_copy=not first)
        out.append(Stage(index, layers, first, last, tuple(tensors)))
    return out


def validate(shape: ModelShape, parallel: Parallel, fmt: WeightFormat) -> None:
    """`PlanError` for a split vLLM (and so tandem) could not run, saying why."""
    tp, pp = parallel.tp, parallel.pp
    if tp < 1 or pp < 1:
        raise PlanError("--tp and --pp must be at least 1")
    if pp > shape.num_layers:
        raise PlanError(f"pp {pp} is more than the model's {shape.num_layers} layers")
    if shape.num_heads % tp:
        raise PlanError(f"tp {tp} does not divide the {shape.num_heads} attention heads")
    kv = shape.num_kv_heads
    if shape.mla is None and kv % tp and tp % kv:
        raise PlanError(f"tp {tp} neither divides the {kv} KV heads nor is a multiple of them")
    moe = shape.moe
    if shape.dense_layers and shape.intermediate_size % tp:
        raise PlanError(f"tp {tp} does not divide the dense MLP width {shape.intermediate_size}")
    if moe:
        if parallel.ep and moe.num_experts % tp:
            raise PlanError(f"--ep deals the {moe.num_experts} routed experts out over the tp ranks: "
                            f"tp {tp} does not divide them")
        if not parallel.ep and moe.expert_intermediate % tp:
            raise PlanError(f"tp {tp} does not divide the experts' width {moe.expert_intermediate}; "
                            "--ep keeps experts whole instead")
        if moe.shared_intermediate % tp:
            raise PlanError(f"tp {tp} does not divide the shared expert's width {moe.shared_intermediate}")
    if fmt.fp8_block and tp > 1:
        _check_fp8_blocks(shape, parallel, fmt.fp8_block)
    if fmt.int_quant and tp > 1:
        _check_int_groups(shape, parallel, fmt)


def _check_int_groups(shape: ModelShape, parallel: Parallel, fmt: WeightFormat) -> None:
    """Each rank's slice of a packed-integer weight must be whole groups of its input columns
    (vLLM's WNA16 layers refuse a row-parallel slice that splits a group) and whole int32 words
    of zero points."""
    seen: set[str] = set()
    for stage in stages(shape, Parallel(parallel.tp, 1, parallel.ep)):
        for t in stage.tensors:
            scheme = int_scheme(t, fmt)
            if scheme is None or t.name in seen or (t.experts and parallel.ep):
                continue
            seen.add(t.name)
            rows, cols, _ = shard_shape(t, parallel)
            hint = "; --ep keeps experts whole" if t.experts else ""
            if t.split is Split.ROW and scheme.strategy == "group" and cols % scheme.group_size:
                raise PlanError(f"{scheme} weights need whole groups on each rank: {t.name} has {t.cols} input "
                                f"columns, {cols} per rank at tp {parallel.tp}, not a multiple of "
                                f"{scheme.group_size}{hint}")
            if t.split is Split.ROW and cols % scheme.per_word:
                raise PlanError(f"{scheme} weights pack {scheme.per_word} columns a word: {t.name} has {cols} "
                                f"per rank at tp {parallel.tp}{hint}")
            if not scheme.symmetric and t.split in (Split.COLUMN, Split.KV_HEADS) and rows % scheme.per_word:
                raise PlanError(f"{scheme} zero points pack {scheme.per_word} rows a word: {t.name} has {rows} "
                                f"rows per rank at tp {parallel.tp}{hint}")


def _check_fp8_blocks(shape: ModelShape, parallel: Parallel, block: tuple[int, int]) -> None:
    """Each rank's slice of an FP8 weight must be whole blocks (vLLM refuses otherwise)."""
    seen: set[str] = set()
    for stage in stages(shape, Parallel(parallel.tp, 1, parallel.ep)):
        for t in stage.tensors:
            if not t.linear or t.name in seen or (t.experts and parallel.ep):
                continue
            seen.add(t.name)
            rows, cols, _ = shard_shape(t, parallel)
            if t.split in (Split.COLUMN, Split.KV_HEADS) and rows % block[0]:
                width, size, axis = t.rows, rows, "rows"
            elif t.split is Split.ROW and cols % block[1]:
                width, size, axis = t.cols, cols, "columns"
            else:
                continue
            hint = "; --ep keeps experts whole" if t.experts else ""
            raise PlanError(f"FP8 {block[0]}x{block[1]} block quantisation needs whole blocks on each "
                            f"rank: {t.name} has {width} {axis}, {size} per rank at tp {parallel.tp}, "
                            f"not a multiple of {block[0] if axis == 'rows' else block[1]}{hint}")


def shard_shape(t: Tensor, parallel: Parallel) -> tuple[int, int, int]:
    """(rows, cols, copies) of `t` on one rank."""
    tp = parallel.tp
    copies = max(t.experts, 1)
    if t.experts and parallel.ep:
        return t.rows, t.cols, copies // parallel.ep_size
    if t.split is Split.COLUMN:
        return t.rows // tp, t.cols, copies
    if t.split is Split.ROW:
        return t.rows, t.cols // tp, copies
    if t.split is Split.KV_HEADS:
        per_head = t.rows // t.heads
        return max(t.heads // tp, 1) * per_head, t.cols, copies
    if t.split is Split.VOCAB:
        return -(-t.rows // tp), t.cols, copies
    return t.rows, t.cols, copies


def tensor_bytes(t: Tensor, parallel: Parallel, fmt: WeightFormat) -> int:
    """Bytes of `t` on one rank, FP8 block scales and packed-integer scales included."""
    rows, cols, copies = shard_shape(t, parallel)
    if t.fp32:
        return rows * cols * copies * 4
    scheme = int_scheme(t, fmt)
    if scheme is not None:
        return copies * scheme.matrix_bytes(rows, cols, DTYPE_BYTES[fmt.dtype])
    if t.linear and fmt.fp8_block:
        br, bc = fmt.fp8_block
        scales = -(-rows // br) * -(-cols // bc)
        return copies * (rows * cols + scales * 4)
    return rows * cols * copies * DTYPE_BYTES[fmt.dtype]


def stage_weight_bytes(stage: Stage, parallel: Parallel, fmt: WeightFormat) -> int:
    """Weight bytes one rank of `stage` holds."""
    return sum(tensor_bytes(t, parallel, fmt) for t in stage.tensors)
