"""fp32 weights times a few activation rows, streamed in their plain layout (csrc/dense_gemv.c).

A one-token fp32 step is bound by the weight bytes it reads. oneDNN's packed GEMM, which
every other fp32 step uses, reads the default model's per-layer matrices at 16-25 GB/s with
one row on the 2-core AVX-512 EPYC; this kernel walks each row of the plain [N, K] matrix
start to end with independent accumulators and reaches 27-38 GB/s on the same matrices
(ad-hoc, 2 threads, the box drifting between runs). Same fp32 products and sums, in another
order: `--decode-weights float32` is exact fp32 arithmetic, like oneDNN's.

The same kernel reads bf16 weights (`tandem_bf16w_gemv`, each widened in registers): a bf16
model's small steps on a CPU whose oneDNN has no bf16 GEMM (an AVX2-only EPYC), where torch's
bf16 GEMV is a generic loop; and a bf16 model's own rows under `--decode-weights bfloat16`
(`tandem_bf16_gemv`, bf16 in and out), where oneDNN's packed bf16 one-row GEMM is the slow
part of a one-token step as its fp32 one is in fp32.

An fp32 matrix whose every block of 32 weights is a scaled, offset small integer (a GGUF's
Q4_1, Q5_0, Q8_0, ... tensors, dequantized) is read from its lossless int8 codes instead
(`tandem_coded_gemv`, kernels/lossless_rows.py): the same fp32 weights and sums, a third of
the bytes.

Compiled on first use like the other C kernels (c_library.py); without a compiler the
caller keeps oneDNN's path.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.kernels.c_library import bind, build_kernel_library, build_or_none
from tandem.kernels.lossless_rows import STEP, code_rows, coded_row_bytes

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "dense_gemv.c"
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class DenseGemvKernel:
    """The loaded C function."""

    def __init__(self, library: Path) -> None:
        signature = (None, [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int])
        functions = bind(library, {
            "tandem_f32_gemv": signature, "tandem_bf16w_gemv": signature, "tandem_coded_gemv": signature,
            "tandem_bf16_gemv": (ctypes.c_int, signature[1]),
            "tandem_f32_gemv_isa": (ctypes.c_char_p, []),
        })
        self._gemv = functions["tandem_f32_gemv"]
        self._bf16w_gemv = functions["tandem_bf16w_gemv"]
        self._coded_gemv = functions["tandem_coded_gemv"]
        self._bf16_gemv = functions["tandem_bf16_gemv"]
        self.isa: str = functions["tandem_f32_gemv_isa"]().decode()

    @classmethod
    def build(cls, cache_dir: Path) -> DenseGemvKernel:
        return cls(build_kernel_library(cache_dir, SOURCE))

    def gemv_entry(self, dtype: torch.dtype = torch.float32) -> object:
        """The C function for rows of `dtype`, fp32 or bf16 throughout (for callers in C)."""
        return self._bf16_gemv if dtype == torch.bfloat16 else self._gemv

    def coded_entry(self) -> object:
        """The C function for coded fp32 rows (for callers in C)."""
        return self._coded_gemv

    def coded_gemv(self, coded: torch.Tensor, n: int, k: int, x: torch.Tensor, bias: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] fp32 @ W.T (+ bias) (+ residual) -> [M, N] fp32, W [N, K] given by its coded
        rows (lossless_rows.code_rows): the outputs `gemv` gives on W itself."""
        if k % STEP or tuple(coded.shape) != (n, coded_row_bytes(k)) or x.shape[-1] != k:
            raise ValueError(f"coded rows {tuple(coded.shape)} do not hold a [{n}, {k}] matrix the kernel reads")
        rows = x.shape[0]
        out = torch.empty(rows, n, dtype=torch.float32)
        self._coded_gemv(coded.data_ptr(), None if bias is None else bias.data_ptr(), x.data_ptr(),
                         None if residual is None else residual.data_ptr(), out.data_ptr(), rows, n, k,
                         torch.get_num_threads())
        return out

    def gemv(self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] fp32 @ weight [N, K].T (+ bias [N]) (+ residual [M, N]) -> [M, N] fp32;
        every tensor contiguous and fp32, but the weight, which may be bf16."""
        rows = x.shape[0]
        out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
        entry = self._bf16w_gemv if weight.dtype == torch.bfloat16 else self._gemv
        entry(weight.data_ptr(), None if bias is None else bias.data_ptr(), x.data_ptr(),
                   None if residual is None else residual.data_ptr(), out.data_ptr(), rows, weight.shape[0],
                   weight.shape[1], torch.get_num_threads())
        return out

    def gemv_bf16(self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] bf16 @ weight [N, K].T bf16 (+ bias [N] fp32) (+ residual [M, N] bf16) ->
        [M, N] bf16: fp32 arithmetic, each output rounded once."""
        rows = x.shape[0]
        out = torch.empty(rows, weight.shape[0], dtype=torch.bfloat16)
        status = self._bf16_gemv(weight.data_ptr(), None if bias is None else bias.data_ptr(), x.data_ptr(),
                                 None if residual is None else residual.data_ptr(), out.data_ptr(), rows,
                                 weight.shape[0], weight.shape[1], torch.get_num_threads())
        if status != 0:
            raise MemoryError("the bf16 GEMV could not allocate its scratch memory")
        return out


def load_dense_gemv_kernel(cache_dir: Path) -> DenseGemvKernel | None:
    """The kernel, or None (and a warning saying why) where it cannot be built here."""
    kernel = build_or_none(DenseGemvKernel.build, cache_dir, "fp32 GEMV kernel",
                           "small steps keep oneDNN's packed weights")
    if kernel is not None:
        logger.info("fp32 GEMV kernel: %s", kernel.isa)
    return kernel


@dataclass
class DenseRows:
    """An fp32 (or bf16) [N, K] matrix kept in its plain row-major layout for the GEMV kernel:
    the same tensor the checkpoint filled, not a copy (held beside oneDNN's packed one). An
    fp32 matrix of small integers in disguise also holds its lossless codes, which fp32 rows
    then read instead (`with_codes`)."""

    weight: torch.Tensor  # fp32 or bf16 [N, K], contiguous
    bias: torch.Tensor | None  # fp32 [N]
    kernel: DenseGemvKernel
    codes: torch.Tensor | None = None  # uint8 [N, coded_row_bytes(K)] (lossless_rows.py), or None

    def with_codes(self) -> bool:
        """Find the weight's lossless codes (fp32 only); whether it has them now."""
        if self.codes is None and self.weight.dtype == torch.float32:
            self.codes = code_rows(self.weight)
        return self.codes is not None

    def matmul(self, x: torch.Tensor, with_bias: bool = True, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ W.T (+ bias) (+ residual, x's leading shape by N), in x's dtype (fp32
        arithmetic: a bf16 x is widened and the result rounded once)."""
        if x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16:  # all bf16: one C call
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            extra = None if residual is None else residual.reshape(flat.shape[0], -1).to(torch.bfloat16).contiguous()
            out = self.kernel.gemv_bf16(self.weight, flat, self.bias if with_bias else None, extra)
            return out.reshape(*x.shape[:-1], self.weight.shape[0])
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        extra = None if residual is None else residual.reshape(rows.shape[0], -1).float().contiguous()
        bias = self.bias if with_bias else None
        if self.codes is not None:
            out = self.kernel.coded_gemv(self.codes, self.weight.shape[0], self.weight.shape[1], rows, bias, extra)
        else:
            out = self.kernel.gemv(self.weight, rows, bias, extra)
        return out.reshape(*x.shape[:-1], self.weight.shape[0]).to(x.dtype)

    def release_plain_rows(self) -> int:
        """Let go of the plain rows where the codes stand for them (the weight becomes a meta
        tensor of its shape and dtype); returns the bytes let go. The caller makes sure no one
        else reads them through this object (a tied head's rows are the embedding's)."""
        if self.codes is None or self.weight.device.type == "meta":
            return 0
        released = self.weight.numel() * self.weight.element_size()
        self.weight = torch.empty(self.weight.shape, dtype=self.weight.dtype, device="meta")
        return released

    @property
    def nbytes(self) -> int:
        """The bytes held: the plain rows' (unless released) and the codes'."""
        codes = 0 if self.codes is None else self.codes.numel()
        rows = 0 if self.weight.device.type == "meta" else self.weight.numel() * self.weight.element_size()
        return rows + codes

    @property
    def read_nbytes(self) -> int:
        """The bytes one product reads: the codes where it has them, else the plain rows."""
        return self.codes.numel() if self.codes is not None else self.weight.numel() * self.weight.element_size()
