"""Steps of a Llama-shaped model, bf16 or fp32, through all its layers in one C call.

A one-token step of SmolLM2 in bf16 with 4-bit decode weights took 9.3 ms on the 2-core
AVX-512 EPYC, of which the C kernels were about half: the rest was Python between them,
some 15 module calls, views and ctypes calls a layer. `DecodeStack` hands the whole layer
loop to csrc/decode_stack.c, which calls the same kernels in the same order, so the hidden
states come out bit-identical to the layer-by-layer path (tested).

Two kinds of steps qualify, each where every piece of a layer has a C kernel (the C norm and
rotary, the C decode attention, no tensor or pipeline split, no q/k norms; biases as Qwen2's
q/k/v ones, added where the layer path adds them):
- small steps, no larger than the small-step copies serve: 4- or 8-bit copies of all four
  projections (`--decode-weights int4`) in bf16, or the model's own plain rows
  (`--decode-weights float32` in fp32, `--decode-weights bfloat16` in bf16);
- larger batches of decode tokens, where all four projections are packed for tandem's dense
  GEMM (bf16 or fp32 weights on AVX-512, bf16 on AMX's tiles) or, under bf16 rows, for its 8-bit GEMM
  with gate/up as pairs (`--quantization int8` on VNNI without AMX: the default mode there).
  At 64 sequences the Python between kernels cost less than at one, but every OpenMP thread
  but the caller's waited through it: 12% of a bf16 decode-heavy run was libgomp's wait, 5%
  the interpreter.
Steps with prefill chunks go through the same call where the backend's C prefill attention
runs the stack's dtype (bf16 on AMX CPUs only where the kernel has its tiles' path)
and head size: the layer is the same sequence, its attention the decode rows in one call and
then each chunk over its sequence's cached context, as the CPU backend runs them, so a
prefill is bit-identical too. A prefill step's Python between kernels was 5% of a bf16 or
exact-fp32 prefill-heavy pass and 15% in the default mode (one process, alternating).
Anything else keeps the module path. In fp32 the stack's norm is the C one, where the module
path runs torch's: the two sum the mean of squares in different orders, so fp32 hidden
states agree to rounding rather than bit for bit (greedy tokens are tested against
transformers, as the exact mode's are).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tandem.kernels.base import AttentionBackend, AttentionMetadata
from tandem.kernels.c_library import KernelBuildError
from tandem.kernels.cpu_attention import KV_KINDS, CpuAttentionBackend
from tandem.kernels.cpu_prefill import PrefillAttentionKernel
from tandem.kernels.decode_stack import DecodeStackKernel, Layer, Matrix, Step
from tandem.kernels.dense_gemm import DenseGemmKernel
from tandem.kernels.dense_gemv import DenseGemvKernel, DenseRows
from tandem.kernels.int8_gemm import Int8GemmKernel
from tandem.kernels.int8_rows import Int8RowsKernel
from tandem.kernels.layer_ops import LayerOpsKernel
from tandem.kernels.q4_gemm import Q4Kernel, Q4Matrix
from tandem.layers.linear import GateUpLinear, Linear
from tandem.models.llama import DecoderAttention, DecoderLayer, DecoderMLP, LlamaForCausalLM

logger = logging.getLogger(__name__)


class DecodeStack:
    """The layer records of one model (made once) and the call for a step: `small` records
    for steps of at most `max_tokens` decode tokens, `large` ones for larger steps."""

    def __init__(self, kernel: DecodeStackKernel, model: LlamaForCausalLM, layers: list[DecoderLayer],
                 max_tokens: int, large_above: int, small: bool, large: bool) -> None:
        self.kernel = kernel
        self.max_tokens = max_tokens  # small records up to here (0: none)
        self.large_above = large_above  # large records past here: where every projection leaves its small copy
        # the biases as the records' kernels read them (converted copies), alive with the records
        self._biases: list[torch.Tensor] = []
        self._small = _records(layers, _small_records, self._biases) if small else None
        self._large = _records(layers, _packed_records, self._biases) if large else None
        first = layers[0]
        self._attention = [layer.self_attn.attn for layer in layers]  # an fp8 cache's scales, read each step
        cfg = model.config
        self._step = Step(hidden=cfg.hidden_size, heads=first.self_attn.num_heads,
                          kv_heads=first.self_attn.num_kv_heads, head_dim=first.self_attn.head_dim,
                          intermediate=cfg.intermediate_size, eps=first.input_layernorm.eps,
                          scale=first.self_attn.attn.scale,
                          element_bytes=torch.empty(0, dtype=kernel.dtype).element_size())

    def _layers_for(self, tokens: int) -> ctypes.Array | None:
        if tokens <= self.max_tokens:
            return self._small
        return self._large if tokens > self.large_above else None

    @property
    def steps(self) -> str:
        """Which steps it takes, for the start-up log."""
        kinds = [f"<= {self.max_tokens}"] if self._small is not None else []
        if self._large is not None:
            kinds.append(f"> {self.large_above}")
        rows = "decode tokens and prefill chunks" if self.kernel.prefills else "decode tokens"
        return f"{' and '.join(kinds)} tokens ({rows})"

    def takes(self, hidden: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> bool:
        """A step in the stack's dtype with records for its size: decode tokens only, or, where
        the stack has the prefill kernel and the cache holds the rows' dtype, decode tokens then
        prefill chunks (the backend's order); not while the profiler runs (its per-phase ranges
        live in the module path). A cache in another dtype (int8, fp8, bf16 under fp32 rows)
        takes decode steps: the stack rounds the step's keys and values into it."""
        tokens, dtype = hidden.shape[0], self.kernel.dtype
        rows = meta.num_decode_tokens + sum(span.q_len for span in meta.prefills)
        kind = KV_KINDS.get(kv_caches[0].dtype)
        own = kv_caches[0].dtype == dtype
        return (hidden.dtype == dtype and tokens > 0 and self._layers_for(tokens) is not None and rows == tokens
                and (not meta.prefills or (self.kernel.prefills and own))
                and kind is not None and (own or kind != 0)
                and kv_caches[0].is_contiguous() and not torch.autograd._profiler_enabled())

    def __call__(self, hidden: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor],
                 kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """`hidden` [tokens, hidden] after every layer (a new tensor)."""
        hidden = hidden.contiguous().clone()
        layers = self._layers_for(hidden.shape[0])
        assert layers is not None, "a step the stack does not take (`takes`)"
        cos, sin = (a.contiguous() for a in angles)
        tables = meta.decode_block_tables.contiguous()
        lens = meta.decode_context_lens.contiguous()
        slots = meta.slot_mapping.contiguous()
        for record, cache, attention in zip(layers, kv_caches, self._attention, strict=True):
            record.kv_cache = cache.data_ptr()
            record.k_scale, record.v_scale = attention.k_scale, attention.v_scale
        step = self._step
        step.kv_kind = KV_KINDS[kv_caches[0].dtype]
        _, _, step.num_blocks, step.block_size, _ = kv_caches[0].shape
        step.tokens, step.table_stride = hidden.shape[0], tables.shape[1]
        step.cos, step.sin = cos.data_ptr(), sin.data_ptr()
        step.slots, step.block_tables, step.context_lens = slots.data_ptr(), tables.data_ptr(), lens.data_ptr()
        step.num_threads = torch.get_num_threads()
        step.decodes, step.spans = meta.num_decode_tokens, len(meta.prefills)
        spans = _Spans(meta) if meta.prefills else None  # alive through the call: the step points at it
        if spans is not None:
            step.span_table_stride = spans.table_stride
            step.span_start, step.span_len = spans.start.data_ptr(), spans.length.data_ptr()
            step.span_context, step.span_blocks = spans.context.data_ptr(), spans.blocks.data_ptr()
        self.kernel(layers, step, hidden)
        return hidden


class _Spans:
    """A step's prefill chunks as the C stack reads them: each chunk's first row, row count
    and context length, and its block ids as a row of one zero-padded table."""

    def __init__(self, meta: AttentionMetadata) -> None:
        spans = meta.prefills
        self.start = torch.tensor([span.q_start for span in spans], dtype=torch.int64)
        self.length = torch.tensor([span.q_len for span in spans], dtype=torch.int64)
        self.context = torch.tensor([span.context_len for span in spans], dtype=torch.int64)
        self.table_stride = max((span.block_ids.numel() for span in spans), default=0)
        self.blocks = torch.zeros(len(spans), self.table_stride, dtype=torch.int64)
        for row, span in zip(self.blocks, spans, strict=True):
            row[:span.block_ids.numel()] = span.block_ids


def _records(layers: list[DecoderLayer], matrices: Callable[[DecoderLayer, list[torch.Tensor]], dict[str, Matrix]],
             keep: list[torch.Tensor]) -> ctypes.Array:
    """One C `Layer` record a decoder layer, its four projections' records from `matrices`
    (which append the tensors the records point at and nothing else holds to `keep`)."""
    records = (Layer * len(layers))()
    for record, layer in zip(records, layers, strict=True):
        record.input_norm = layer.input_layernorm.weight.data_ptr()
        record.post_norm = layer.post_attention_layernorm.weight.data_ptr()
        for name, matrix in matrices(layer, keep).items():
            setattr(record, name, matrix)
    return records


def _bias(projection: Linear, dtype: torch.dtype, keep: list[torch.Tensor]) -> torch.Tensor | None:
    """The projection's bias in `dtype`, contiguous (kept in `keep`), or None."""
    bias = getattr(projection, "bias", None)
    if bias is None:
        return None
    keep.append(bias.detach().to(dtype).contiguous())
    return keep[-1]


def _projections(layer: DecoderLayer) -> dict[str, Linear]:
    attn, mlp = layer.self_attn, layer.mlp
    return {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}


def _small_records(layer: DecoderLayer, keep: list[torch.Tensor]) -> dict[str, Matrix]:
    dtype = layer.input_layernorm.weight.dtype
    return {name: Matrix.of(_small_matrix(p), bias=_bias(p, dtype, keep)) for name, p in _projections(layer).items()}


def _packed_records(layer: DecoderLayer, keep: list[torch.Tensor]) -> dict[str, Matrix]:
    projections = _projections(layer)
    dtype = layer.input_layernorm.weight.dtype
    if projections["qkv"].int8 is not None:  # the 8-bit copies (`_int8_fits`)
        records = {}
        for name, p in projections.items():
            w = p.int8
            assert w is not None and w.packed is not None
            records[name] = Matrix.int8(w.packed, w.scales, w.columns, w.outliers, w.gate_up_pairs,
                                        _bias(p, dtype, keep))
        return records
    records = {name: Matrix.of(p.dense_packed, bias=_bias(p, dtype, keep))
               for name, p in projections.items() if name != "gate_up"}
    gate_up = layer.mlp.gate_up_proj
    assert isinstance(gate_up, GateUpLinear) and gate_up.gated_packed is not None
    records["gate_up"] = Matrix.of(gate_up.gated_packed, gated=True, bias=_bias(gate_up, dtype, keep))
    return records


def _small_matrix(projection: Linear) -> Q4Matrix | DenseRows | None:
    """What a small step reads for `projection` in the stack: its 4/8-bit copy, or the
    model's own plain rows (fp32, or bf16 under `--decode-weights bfloat16`)."""
    return projection.small_quantized if projection.small_quantized is not None else projection.small_dense


def _fits(matrix: object, dtype: torch.dtype) -> bool:
    """A matrix the stack's kernels read for `dtype` rows: 4/8-bit copies in bf16, plain rows
    of the rows' own dtype in either."""
    if isinstance(matrix, DenseRows):
        return matrix.weight.dtype == dtype
    return isinstance(matrix, Q4Matrix) and dtype == torch.bfloat16


def _small_fits(layer: DecoderLayer, dtype: torch.dtype) -> bool:
    """Whether small steps of every projection read a copy the stack runs, and its bias (if
    any) is added as the layer path adds it: by the GEMV, or after a 4/8-bit product that has
    no residual to fuse (qkv, gate/up; o and down fuse theirs, and the layer path then adds
    bias and residual in another order)."""
    for name, p in _projections(layer).items():
        matrix, bias = _small_matrix(p), getattr(p, "bias", None)
        if not _fits(matrix, dtype) or p.small_step is None:
            return False
        if bias is not None and not (isinstance(matrix, DenseRows) and matrix.bias is not None) and not (
                isinstance(matrix, Q4Matrix) and name in ("qkv", "gate_up") and bias.dtype == dtype):
            return False
    return True


def _packed_fits(layer: DecoderLayer, dtype: torch.dtype) -> bool:
    """Whether larger steps of every projection read dense_gemm.c's packed `dtype` blocks
    (gate/up: its gated layout), with no bias and no other copy taking those steps first."""
    projections = _projections(layer)
    for p in projections.values():
        if p.int4 is not None or p.int8 is not None or p.gemv_rows is not None or p.dense_gemm is None:
            return False
    gate_up = projections.pop("gate_up")
    if not isinstance(gate_up, GateUpLinear):
        return False
    packed = [p.dense_packed for p in projections.values()] + [gate_up.gated_packed]
    return all(m is not None and m.rows_dtype == dtype for m in packed)


def _int8_fits(layer: DecoderLayer) -> tuple[Int8RowsKernel, Int8GemmKernel] | None:
    """The 8-bit kernels where larger steps of every projection read packed 8-bit weights
    through them, gate/up as pairs, as `gated_mlp` runs them (the vector row passes, no bias
    on gate/up, widths the passes take); else None."""
    kernels = None
    for name, p in _projections(layer).items():
        weight = p.int8
        if (weight is None or weight.packed is None or weight.gemm is None or weight.kernel is None
                or weight.kernel.isa != "avx512" or (name == "gate_up" and getattr(p, "bias", None) is not None)
                or p.gemv_rows is not None
                or weight.gate_up_pairs != (name == "gate_up") or weight.outliers > weight.kernel.max_outliers
                or max(weight.columns.shape) > weight.kernel.max_cols):
            return None
        kernels = kernels or (weight.kernel, weight.gemm)
    return kernels


def _stack_layers(model: nn.Module, backend: AttentionBackend, dtype: torch.dtype) -> list[DecoderLayer] | None:
    """The model's decoder layers where every piece but the projections has its C kernel for
    `dtype` rows, else None."""
    if not isinstance(model, LlamaForCausalLM) or model.tp.split or not (model.stage.is_first and model.stage.is_last):
        return None
    if not isinstance(backend, CpuAttentionBackend) or model.rotary.ops is None or model.rotary.cos.dtype != dtype:
        return None
    layers = list(model._own_layers)
    for layer in layers:
        if type(layer) is not DecoderLayer or type(layer.self_attn) is not DecoderAttention:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        if type(mlp) is not DecoderMLP or attn.q_norm is not None:
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(n.ops is None or n.weight.dtype != dtype or n.eps != layers[0].input_layernorm.eps for n in norms):
            return None
    return layers or None


def attach_decode_stack(model: nn.Module, backend: AttentionBackend, cache_dir: Path, q4: Q4Kernel | None,
                        ops: LayerOpsKernel | None, gemv: DenseGemvKernel | None = None) -> DecodeStack | None:
    """Give `model` a `DecodeStack` where it qualifies: for small steps, bf16 with the 4-bit
    GEMMs (`q4`) or the bf16 GEMV on its own rows (`gemv`), or fp32 with the fp32 GEMV
    (`gemv`); for larger ones, weights packed for tandem's dense GEMM. Returns it, or None."""
    cos = getattr(getattr(model, "rotary", None), "cos", None)
    dtype = cos.dtype if isinstance(cos, torch.Tensor) else None
    if dtype not in (torch.bfloat16, torch.float32) or ops is None:
        return None
    layers = _stack_layers(model, backend, dtype)
    if layers is None:
        return None
    assert isinstance(model, LlamaForCausalLM) and isinstance(backend, CpuAttentionBackend)
    projections = [list(_projections(layer).values()) for layer in layers]
    small = all(_small_fits(layer, dtype) for layer in layers)
    matrices = [_small_matrix(p) for layer in projections for p in layer] if small else []
    needs_q4 = any(isinstance(m, Q4Matrix) for m in matrices)
    needs_gemv = any(isinstance(m, DenseRows) for m in matrices)
    small = small and not (needs_q4 and q4 is None) and not (needs_gemv and gemv is None)
    dense: DenseGemmKernel | None = None
    # 8-bit weights under fp32 rows stay on the module path: there the stack's C norm rounds
    # otherwise than torch's, and where a row's quantization lands on another level that grew
    # into other greedy tokens (tested); bf16 rows take the module path's bits.
    int8 = _int8_fits(layers[0]) if dtype == torch.bfloat16 else None
    if all(_packed_fits(layer, dtype) for layer in layers):
        dense = projections[0][0].dense_gemm
    elif int8 is not None and not all(_int8_fits(layer) == int8 for layer in layers):
        int8 = None
    large = dense is not None or int8 is not None
    if not (small or large):
        return None
    try:
        prefill = backend.prefill if backend.prefill is not None and PrefillAttentionKernel.takes_head_dim(
            layers[0].self_attn.head_dim) else None
        kernel = DecodeStackKernel.build(cache_dir, dtype, ops, backend.kernel, q4=q4 if small and needs_q4 else None,
                                         gemv=gemv if small and needs_gemv else None, dense=dense, int8=int8,
                                         prefill=prefill)
    except KernelBuildError as error:
        logger.warning("decode stack unavailable (%s); decode steps run layer by layer", error)
        return None
    small_steps = [p.small_step.max_tokens for layer in projections for p in layer if p.small_step is not None]
    model.decode_stack = DecodeStack(kernel, model, layers, min(small_steps) if small else 0,
                                     max(small_steps, default=0), small, large)
    return model.decode_stack
