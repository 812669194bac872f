"""The passes around an 8-bit GEMM, in C (csrc/int8_rows.c): quantize rows, dequantize with
a bias and a residual folded in.

As torch ops these passes cost more than the integer GEMM saves; in C each is one pass over
memory (see the source's header for the figures). Built on first use like the attention
kernels (c_library.py); where it cannot be built, layers/int8.py runs the same arithmetic as
torch ops.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from tandem.kernels.c_library import KernelBuildError, build_kernel_library

logger = logging.getLogger(__name__)

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
        try:
            loaded = ctypes.CDLL(str(library))
            self._quantize = loaded.tandem_quantize_rows
            self._dequantize = loaded.tandem_dequantize
            max_cols = loaded.tandem_int8_max_cols
        except (OSError, AttributeError) as error:
            raise KernelBuildError(f"cannot load {library}: {error}") from error
        self._quantize.restype = None
        self._quantize.argtypes = [_PTR, _INT, _I64, _I64, _I64, _PTR, _PTR, _INT]
        self._dequantize.restype = None
        self._dequantize.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _INT, _INT]
        max_cols.restype = _INT
        self.max_cols: int = max_cols()

    @classmethod
    def build(cls, cache_dir: Path) -> Int8RowsKernel:
        return cls(build_kernel_library(cache_dir, SOURCE))

    def takes(self, x: torch.Tensor, width: int) -> bool:
        """Whether these rows (and outputs `width` wide) are ones the kernel reads: fp32 or
        bf16, a dense last dimension."""
        return (x.dtype in _KINDS and x.dim() == 2 and x.stride(1) == 1
                and x.shape[1] <= self.max_cols and width <= self.max_cols)

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (int8 [M, K], fp32 scales [M, 1])."""
        rows, cols = x.shape
        values = torch.empty(rows, cols, dtype=torch.int8)
        scales = torch.empty(rows, 1, dtype=torch.float32)
        self._quantize(x.data_ptr(), _KINDS[x.dtype], rows, cols, x.stride(0), values.data_ptr(),
                       scales.data_ptr(), torch.get_num_threads())
        return values, scales

    def dequantize(self, products: torch.Tensor, row_scales: torch.Tensor, col_scales: torch.Tensor,
                   dtype: torch.dtype, bias: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
        """products int32 [M, N] -> [M, N] in dtype (+ bias [N]) (+ residual [M, N])."""
        rows, cols = products.shape
        out = torch.empty(rows, cols, dtype=dtype)
        bias = None if bias is None else bias.to(dtype).contiguous()
        residual = None if residual is None else residual.to(dtype).contiguous()
        self._dequantize(products.data_ptr(), rows, cols, row_scales.data_ptr(), col_scales.data_ptr(),
                         _pointer(bias), _pointer(residual), out.data_ptr(), _KINDS[dtype], torch.get_num_threads())
        return out


def load_int8_rows_kernel(cache_dir: Path) -> Int8RowsKernel | None:
    """The kernel, or None (and a warning saying why) where it cannot be built here."""
    try:
        return Int8RowsKernel.build(cache_dir)
    except KernelBuildError as error:
        logger.warning("int8 row kernels unavailable (%s); --quantization int8 uses torch ops around the GEMM", error)
        return None
