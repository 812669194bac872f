"""Every decoder layer of a bf16 or fp32 step in one C call (csrc/decode_stack.c).

The C side only sequences kernels tandem already has (the 4-bit GEMMs or the GEMVs for small
steps, the packed dense GEMM for larger ones, the layer passes, decode attention and, for
steps with prefill chunks, prefill attention), called through their function pointers, so
this module's job is to lay out what they read: a `Layer` record per decoder layer, made
once, and a `Step` record per call. Which models and steps qualify is the model's business
(tandem/models/decode_stack.py).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tandem.kernels.c_library import bind, build_kernel_library
from tandem.kernels.cpu_attention import PagedDecodeKernel
from tandem.kernels.cpu_prefill import PrefillAttentionKernel
from tandem.kernels.dense_gemm import DenseGemmKernel, PackedDense
from tandem.kernels.dense_gemv import DenseGemvKernel, DenseRows
from tandem.kernels.int8_gemm import Int8GemmKernel, PackedInt8
from tandem.kernels.int8_rows import Int8RowsKernel
from tandem.kernels.layer_ops import LayerOpsKernel
from tandem.kernels.q4_gemm import Q4Kernel, Q4Matrix

SOURCE = Path(__file__).parent / "csrc" / "decode_stack.c"
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def _pointer(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


def _address(function: object) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value or 0


class Kernels(ctypes.Structure):
    _fields_ = [(name, _PTR) for name in ("gemm4", "gemm5", "gemm8", "gemv32", "gemv16", "rms_norm", "rotary", "silu_mul",
                                          "write_kv", "attend", "dense_gemm", "dense_silu_mul", "quantize_rows",
                                          "int8_dequantize", "int8_gated", "write_i8", "write_bf16",
                                          "write_f8", "gemv_coded", "attend_in_team", "prefill_spans")]


# `Matrix.bits` for the dense GEMM's packed layouts, the int8 GEMM's and fp32 rows' lossless
# codes (the C side's names), apart from the bit counts a small step's matrices give (4, 5, 8,
# 16, 32).
PACKED, PACKED_GATED, INT8, INT8_GATED, CODED, PACKED_W8, PACKED_W8_GATED = 101, 102, 103, 104, 105, 106, 107


class Matrix(ctypes.Structure):
    _fields_ = [("levels", _PTR), ("scales", _PTR), ("mins", _PTR), ("n", _I64), ("k", _I64), ("bits", _I64),
                ("compensation", _PTR), ("col_scales", _PTR), ("columns", _PTR), ("outliers", _I64), ("bias", _PTR)]

    @classmethod
    def int8(cls, packed: PackedInt8, col_scales: torch.Tensor, columns: torch.Tensor, outliers: int,
             gated: bool, bias: torch.Tensor | None = None) -> Matrix:
        """The record of a packed 8-bit matrix: its blocks (`gated`: gate/up pairs), the
        columns' fp32 scales, the [in, out] int8 matrix the outliers meet, and how many
        outliers a row of its input sets aside (layers/int8.py `Int8Weight`); `bias` in the
        rows' dtype, contiguous, kept alive by the caller."""
        return cls(packed.values.data_ptr(), None, None, packed.out_features, packed.in_features,
                   INT8_GATED if gated else INT8, packed.compensation.data_ptr(), col_scales.data_ptr(),
                   columns.data_ptr(), outliers, _pointer(bias))

    @classmethod
    def of(cls, matrix: Q4Matrix | DenseRows | PackedDense, gated: bool = False,
           bias: torch.Tensor | None = None) -> Matrix:
        """The record of a small step's matrix, or of a packed one (`gated`: `pack_gated`'s
        gate/up layout, whose GEMM writes silu(gate) * up). `bias` (contiguous, kept alive by
        the caller): in the rows' dtype for a packed matrix, bf16 added after a 4/8-bit
        product; a GEMV's rows bring their own fp32 one."""
        if isinstance(matrix, PackedDense):  # 8-bit weights (int8 values) read by the same GEMM, kind 3
            w8 = matrix.values.dtype == torch.int8
            bits = (PACKED_W8_GATED if w8 else PACKED_GATED) if gated else (PACKED_W8 if w8 else PACKED)
            return cls(matrix.values.data_ptr(), None, None, matrix.out_features, matrix.in_features, bits,
                       bias=_pointer(bias))
        if isinstance(matrix, DenseRows) and matrix.codes is not None:  # fp32 rows read from their codes
            return cls(matrix.codes.data_ptr(), None, None, matrix.weight.shape[0], matrix.weight.shape[1], CODED,
                       bias=_pointer(matrix.bias))
        if isinstance(matrix, DenseRows):  # bits 32 / 16: plain fp32 / bf16 rows, `levels` pointing at them
            return cls(matrix.weight.data_ptr(), None, None, matrix.weight.shape[0], matrix.weight.shape[1],
                       8 * matrix.weight.element_size(), bias=_pointer(matrix.bias))
        return cls(matrix.nibbles.data_ptr(), matrix.scales.data_ptr(), _pointer(matrix.mins),
                   matrix.out_features, matrix.in_features, matrix.bits, bias=_pointer(bias))


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", _PTR), ("post_norm", _PTR), ("qkv", Matrix), ("o", Matrix), ("gate_up", Matrix),
                ("down", Matrix), ("kv_cache", _PTR), ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float)]


class Step(ctypes.Structure):
    _fields_ = [*[(name, _I64) for name in ("tokens", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                            "block_size", "num_blocks", "table_stride", "element_bytes")],
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                *[(name, _PTR) for name in ("cos", "sin", "slots", "block_tables", "context_lens")],
                ("num_threads", ctypes.c_int),
                *[(name, _I64) for name in ("decodes", "spans", "span_table_stride")],
                *[(name, _PTR) for name in ("span_start", "span_len", "span_context", "span_blocks")],
                ("kv_kind", _I64)]


class DecodeStackKernel:
    """The loaded sequencer and the kernels it calls for one row dtype: for small steps, bf16
    rows with the 4/8-bit GEMMs (`q4`) and/or the bf16 GEMV on plain bf16 weights (`gemv`),
    or fp32 rows with the fp32 GEMV (`gemv`); for larger ones, the packed dense GEMM
    (`dense`) in either, or the 8-bit one with its row passes (`int8`). Their libraries stay
    loaded: the objects holding them are kept here."""

    def __init__(self, library: Path, dtype: torch.dtype, ops: LayerOpsKernel, attention: PagedDecodeKernel,
                 q4: Q4Kernel | None = None, gemv: DenseGemvKernel | None = None,
                 dense: DenseGemmKernel | None = None,
                 int8: tuple[Int8RowsKernel, Int8GemmKernel] | None = None,
                 prefill: PrefillAttentionKernel | None = None) -> None:
        if (dtype not in (torch.bfloat16, torch.float32) or (q4 is not None and dtype != torch.bfloat16)
                or (q4 is None and gemv is None and dense is None and int8 is None)
                or (dense is not None and not dense.multiplies(dtype))):
            raise ValueError("a decode stack runs bf16 rows with the 4-bit GEMMs, the bf16 GEMV or the packed bf16 "
                             "GEMM, or fp32 rows with the fp32 GEMV or the packed fp32 GEMM")
        self._run = bind(library, {
            "tandem_decode_stack": (ctypes.c_int, [_PTR, _PTR, _I64, _PTR, _PTR]),
        })["tandem_decode_stack"]
        self.dtype = dtype
        self._holds = (q4, gemv, dense, int8, ops, attention, prefill)
        # steps with prefill chunks too, where the prefill kernel attends in this dtype
        self.prefills = prefill is not None and dtype in prefill.dtypes
        rows, gemm = int8 if int8 is not None else (None, None)
        self.kernels = Kernels(
            *(_address(q4.gemm_entry(bits, dtype)) if q4 else None for bits in (4, 5, 8)),
            _address(gemv.gemv_entry(torch.float32)) if gemv and dtype == torch.float32 else None,
            _address(gemv.gemv_entry(torch.bfloat16)) if gemv and dtype == torch.bfloat16 else None,
            _address(ops.rms_norm_entry(dtype)), _address(ops.rotary_entry(dtype)),
            _address(ops.silu_mul_entry(dtype)), _address(attention.write_kv_entry()),
            _address(attention.attend_entry()),
            _address(dense.gemm_entry()) if dense else None, _address(dense.silu_mul_entry()) if dense else None,
            _address(rows.quantize_entry()) if rows else None,
            _address(gemm.dequantize_entry()) if gemm else None, _address(gemm.gated_entry()) if gemm else None,
            *(_address(entry) for entry in attention.rounding_write_entries()),
            _address(gemv.coded_entry()) if gemv and dtype == torch.float32 else None,
            _address(attention.team_entry()),
            _address(prefill.spans_entry()) if prefill is not None and self.prefills else None,
        )

    @classmethod
    def build(cls, cache_dir: Path, dtype: torch.dtype, ops: LayerOpsKernel, attention: PagedDecodeKernel,
              q4: Q4Kernel | None = None, gemv: DenseGemvKernel | None = None,
              dense: DenseGemmKernel | None = None,
              int8: tuple[Int8RowsKernel, Int8GemmKernel] | None = None,
              prefill: PrefillAttentionKernel | None = None) -> DecodeStackKernel:
        return cls(build_kernel_library(cache_dir, SOURCE), dtype, ops, attention, q4, gemv, dense, int8, prefill)

    def __call__(self, layers: ctypes.Array, step: Step, hidden: torch.Tensor) -> None:
        """Run `hidden` [tokens, hidden] (the stack's dtype, contiguous; updated in place)
        through `layers`."""
        status = self._run(ctypes.byref(self.kernels), layers, len(layers), ctypes.byref(step), hidden.data_ptr())
        if status != 0:
            raise RuntimeError("the decode stack stopped: its scratch memory could not be allocated or a kernel "
                               "refused its shapes")

