"""The passes around an 8-bit GEMM, in C (csrc/int8_rows.c): quantize rows, dequantize with
a bias and a residual folded in.

As torch ops these passes cost more than the integer GEMM saves; in C each is one pass over
memory (see the source's header for the figures). Built on first use like the attention
kernels (c_library.py); where it cannot be built, layers/int8.py runs the same arithmetic as
torch ops.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch

from tandem.kernels.c_library import bind, build_kernel_library, build_or_none

SOURCE = Path(__file__).parent / "csrc" / "int8_rows.c"
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_PTR = ctypes.c_void_p
_KINDS = {torch.float32: 0, torch.bfloat16: 1}


def _pointer(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


class Int8RowsKernel:
    """The loaded C functions, called on tensors' data pointers."""

    def __init__(self, library: Path) -> None:
        functions = bind(library, {
            "tandem_quantize_rows": (None, [_PTR, _INT, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _INT]),
            "tandem_dequantize": (None, [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR,
                                         _INT, _INT]),
            "tandem_int8_max_cols": (_INT, []),
            "tandem_int8_max_outliers": (_INT, []),
            "tandem_int8_rows_isa": (ctypes.c_char_p, []),
            "tandem_gated_quantize": (None, [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _INT, _PTR, _PTR,
                                             _I64, _PTR, _PTR, _INT]),
        })
        self._quantize = functions["tandem_quantize_rows"]
        self._dequantize = functions["tandem_dequantize"]
        self._gated_quantize = functions["tandem_gated_quantize"]
        self.max_cols: int = functions["tandem_int8_max_cols"]()
        self.max_outliers: int = functions["tandem_int8_max_outliers"]()
        self.isa: str = functions["tandem_int8_rows_isa"]().decode()  # "avx512" or "portable C"

    # The C function itself, for callers in C (tandem/kernels/decode_stack.py).
    def quantize_entry(self) -> object:
        return self._quantize

    @classmethod
    def build(cls, cache_dir: Path) -> Int8RowsKernel:
        return cls(build_kernel_library(cache_dir, SOURCE))

    def takes(self, x: torch.Tensor, width: int) -> bool:
        """Whether these rows (and outputs `width` wide) are ones the kernel reads: fp32 or
        bf16, a dense last dimension."""
        return (x.dtype in _KINDS and x.dim() == 2 and x.stride(1) == 1
                and x.shape[1] <= self.max_cols and width <= self.max_cols)

    def quantize_rows(self, x: torch.Tensor, outliers: int = 0) -> QuantizedRows:
        """x [M, K] -> int8 [M, K] and fp32 scales [M, 1], each row's `outliers` largest
        magnitudes set aside exactly (their int8 values 0)."""
        if outliers > self.max_outliers:
            raise ValueError(f"at most {self.max_outliers} outlier channels a row, not {outliers}")
        rows, cols = x.shape
        values = torch.empty(rows, cols, dtype=torch.int8)
        scales = torch.empty(rows, 1, dtype=torch.float32)
        index = torch.empty(rows, outliers, dtype=torch.int32)
        value = torch.empty(rows, outliers, dtype=torch.float32)
        self._quantize(x.data_ptr(), _KINDS[x.dtype], rows, cols, x.stride(0), values.data_ptr(),
                       scales.data_ptr(), outliers, index.data_ptr(), value.data_ptr(), torch.get_num_threads())
        return QuantizedRows(values, scales, index, value)

    def dequantize(self, products: torch.Tensor, rows_in: QuantizedRows, col_scales: torch.Tensor,
                   weight_t: torch.Tensor | None, dtype: torch.dtype, bias: torch.Tensor | None,
                   residual: torch.Tensor | None) -> torch.Tensor:
        """products int32 [M, N] -> [M, N] in dtype, the rows' outliers added through the
        transposed int8 weight `weight_t` [K, N] (+ bias [N]) (+ residual [M, N])."""
        rows, cols = products.shape
        out = torch.empty(rows, cols, dtype=dtype)
        bias = None if bias is None else bias.to(dtype).contiguous()
        residual = None if residual is None else residual.to(dtype).contiguous()
        outliers = rows_in.outlier_index.shape[1]
        if outliers and weight_t is None:
            raise ValueError("rows with outliers need the transposed weight")
        self._dequantize(products.data_ptr(), rows, cols, rows_in.scales.data_ptr(), col_scales.data_ptr(),
                         outliers, rows_in.outlier_index.data_ptr(), rows_in.outlier_value.data_ptr(),
                         _pointer(weight_t), _pointer(bias), _pointer(residual), out.data_ptr(), _KINDS[dtype],
                         torch.get_num_threads())
        return out

    def gated_quantize(self, products: torch.Tensor, rows_in: QuantizedRows, col_scales: torch.Tensor,
                       weight_t: torch.Tensor | None, dtype: torch.dtype, outliers: int) -> QuantizedRows:
        """A gate/up projection's products int32 [M, 2 * I] -> silu(gate) * up, with `dtype`'s
        roundings, quantized for the down projection: `dequantize`, silu-and-mul and
        `quantize_rows` in one pass (int8 [M, I], each row's `outliers` set aside)."""
        if outliers > self.max_outliers:
            raise ValueError(f"at most {self.max_outliers} outlier channels a row, not {outliers}")
        rows, width = products.shape
        inter = width // 2
        outliers_in = rows_in.outlier_index.shape[1]
        if outliers_in and weight_t is None:
            raise ValueError("rows with outliers need the transposed weight")
        values = torch.empty(rows, inter, dtype=torch.int8)
        scales = torch.empty(rows, 1, dtype=torch.float32)
        index = torch.empty(rows, outliers, dtype=torch.int32)
        value = torch.empty(rows, outliers, dtype=torch.float32)
        self._gated_quantize(products.data_ptr(), rows, inter, rows_in.scales.data_ptr(), col_scales.data_ptr(),
                             outliers_in, rows_in.outlier_index.data_ptr(), rows_in.outlier_value.data_ptr(),
                             _pointer(weight_t), _KINDS[dtype], values.data_ptr(), scales.data_ptr(), outliers,
                             index.data_ptr(), value.data_ptr(), torch.get_num_threads())
        return QuantizedRows(values, scales, index, value)


class QuantizedRows(NamedTuple):
    """Activation rows in int8 with a scale each, and each row's outliers kept exact."""

    values: torch.Tensor  # int8 [M, K] (0 at the outliers' columns)
    scales: torch.Tensor  # fp32 [M, 1]
    outlier_index: torch.Tensor  # int32 [M, outliers]
    outlier_value: torch.Tensor  # fp32 [M, outliers]


def load_int8_rows_kernel(cache_dir: Path) -> Int8RowsKernel | None:
    """The kernel, or None (and a warning saying why) where it cannot be built here."""
    return build_or_none(Int8RowsKernel.build, cache_dir, "int8 row kernels",
                         "--quantization int8 uses torch ops around the GEMM")
