"""tandem's 8-bit GEMM over weights packed once at load (csrc/int8_gemm.c), for CPUs with
AVX-512-VNNI, on AMX's int8 tiles where the CPU has them (csrc/int8_gemm_amx.h).

`torch._int_mm` (oneDNN) repacks the weight matrix on every call; a 64-sequence decode step
of the default model spent a quarter of its time there. Packed once, the same integers come
out 1.3x faster at 64 rows, 1.7x at 16 and 1.4x in prefill chunks on the 2-core AVX-512 EPYC
(the source's header has the figures). On the 2-core Xeon with AMX the tiles multiply the
same blocks at 4.3-4.9 TOP/s at 2,048 rows, where `torch._int_mm` ran the 8-bit linears at
~2.3: `--quantization int8` there went from ~1,000 to ~1,730 output tok/s on decode-heavy
(docs/performance.md). Both paths give the same int32 products.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch

from tandem.kernels.c_library import bind, build_kernel_library, build_or_none

SOURCE = Path(__file__).parent / "csrc" / "int8_gemm.c"
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_PTR = ctypes.c_void_p
_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1}  # csrc/int8_dequantize.h's kind
BLOCK_COLUMNS = 16  # output columns a packed block holds
K_GROUP = 4  # consecutive k a vpdpbusd lane sums


class PackedInt8(NamedTuple):
    """An int8 [in, out] matrix in the kernel's layout, and 128 x each column's sum."""

    values: torch.Tensor  # int8 [out / 16, in / 4, 16, 4]
    compensation: torch.Tensor  # int32 [out]

    @property
    def in_features(self) -> int:
        return self.values.shape[1] * K_GROUP

    @property
    def out_features(self) -> int:
        return self.values.shape[0] * BLOCK_COLUMNS

    def columns(self) -> torch.Tensor:
        """The matrix back as int8 [in, out] (torch ops; for tests and rare fallbacks)."""
        blocks, quads = self.values.shape[:2]
        return self.values.permute(1, 3, 0, 2).reshape(quads * K_GROUP, blocks * BLOCK_COLUMNS)


class Int8GemmKernel:
    """The loaded C functions, called on tensors' data pointers."""

    def __init__(self, library: Path) -> None:
        functions = bind(library, {
            "tandem_int8_pack": (None, [_PTR, _I64, _I64, _PTR, _PTR, _INT]),
            "tandem_int8_gemm": (_INT, [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _INT]),
            "tandem_int8_gemm_dequantize": (_INT, [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR,
                                                   _PTR, _PTR, _PTR, _PTR, _PTR, _INT, _INT]),
            "tandem_int8_gemm_gated": (_INT, [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR,
                                              _PTR, _PTR, _INT, _INT]),
            "tandem_int8_gemm_isa": (ctypes.c_char_p, []),
            "tandem_int8_gemm_max_inner": (_INT, []),
        })
        self._pack = functions["tandem_int8_pack"]
        self._gemm = functions["tandem_int8_gemm"]
        self._gemm_dequantize = functions["tandem_int8_gemm_dequantize"]
        self._gemm_gated = functions["tandem_int8_gemm_gated"]
        self.isa: str = functions["tandem_int8_gemm_isa"]().decode()  # "avx512-vnni" or "none"
        self.max_inner: int = functions["tandem_int8_gemm_max_inner"]()

    # The C functions themselves, for callers in C (tandem/kernels/decode_stack.py).
    def dequantize_entry(self) -> object:
        return self._gemm_dequantize

    def gated_entry(self) -> object:
        return self._gemm_gated

    @classmethod
    def build(cls, cache_dir: Path) -> Int8GemmKernel:
        return cls(build_kernel_library(cache_dir, SOURCE))

    def fits(self, in_features: int, out_features: int) -> bool:
        """Whether a matrix of this shape can be packed and multiplied here."""
        return (self.isa != "none" and in_features % K_GROUP == 0 and out_features % BLOCK_COLUMNS == 0
                and 0 < in_features <= self.max_inner and out_features > 0)

    def pack(self, columns: torch.Tensor) -> PackedInt8:
        """int8 [in, out] (contiguous) -> the packed matrix."""
        in_features, out_features = columns.shape
        if columns.dtype != torch.int8 or not self.fits(in_features, out_features):
            raise ValueError(f"the int8 GEMM packs int8 [in, out] matrices with in % 4 == 0 and out % 16 == 0 "
                             f"(in <= {self.max_inner}) on an AVX-512-VNNI build, got {tuple(columns.shape)} "
                             f"{columns.dtype} ({self.isa})")
        columns = columns.contiguous()
        values = torch.empty(out_features // BLOCK_COLUMNS, in_features // K_GROUP, BLOCK_COLUMNS, K_GROUP,
                             dtype=torch.int8)
        compensation = torch.empty(out_features, dtype=torch.int32)
        self._pack(columns.data_ptr(), in_features, out_features, values.data_ptr(), compensation.data_ptr(),
                   torch.get_num_threads())
        return PackedInt8(values, compensation)

    def pack_gate_up(self, columns: torch.Tensor) -> PackedInt8:
        """A gated MLP's int8 [in, 2 x intermediate] columns (gate then up) -> packed with its
        blocks alternating gate and up, the same 16 intermediate columns a pair, for `gated`
        (its products are in that order: `matmul` on it is not the plain product)."""
        in_features, out_features = columns.shape
        if out_features % (2 * BLOCK_COLUMNS) != 0:
            raise ValueError(f"a gate/up matrix has 2 x intermediate columns, intermediate % 16 == 0, got {out_features}")
        halves = columns.reshape(in_features, 2, out_features // (2 * BLOCK_COLUMNS), BLOCK_COLUMNS)
        return self.pack(halves.transpose(1, 2).reshape(in_features, out_features))

    @staticmethod
    def _check_rows(a: torch.Tensor, packed: PackedInt8) -> None:
        if a.dim() != 2 or a.dtype != torch.int8 or a.stride(1) != 1 or a.shape[1] != packed.in_features:
            raise ValueError(f"int8 rows [M, {packed.in_features}] with a dense last dimension expected, "
                             f"got {tuple(a.shape)} {a.dtype} strides {a.stride()}")

    def matmul(self, a: torch.Tensor, packed: PackedInt8) -> torch.Tensor:
        """a int8 [M, in] (rows dense, any row stride) @ the packed matrix -> int32 [M, out]."""
        self._check_rows(a, packed)
        rows, in_features = a.shape
        out = torch.empty(rows, packed.out_features, dtype=torch.int32)
        status = self._gemm(a.data_ptr(), a.stride(0), rows, in_features, packed.values.data_ptr(),
                            packed.compensation.data_ptr(), out.data_ptr(), packed.out_features,
                            torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"the int8 GEMM refused a [{rows}, {in_features}] x {tuple(packed.columns().shape)} "
                               f"product ({self.isa} build)")
        return out


    def _epilogue_arguments(self, a: torch.Tensor, packed: PackedInt8, row_scales: torch.Tensor,
                            col_scales: torch.Tensor, outlier_index: torch.Tensor, outlier_value: torch.Tensor,
                            weight_t: torch.Tensor | None, dtype: torch.dtype) -> list:
        """The arguments the dequantizing entry points share, checked: rows, products and
        the dequantize step's inputs (csrc/int8_dequantize.h)."""
        self._check_rows(a, packed)
        if dtype not in _OUT_KINDS:
            raise ValueError(f"the int8 GEMM's epilogue writes fp32 or bf16 roundings, not {dtype}")
        outliers = outlier_index.shape[1]
        if outliers and weight_t is None:
            raise ValueError("rows with outliers need the transposed weight")
        return [a.data_ptr(), a.stride(0), a.shape[0], a.shape[1], packed.values.data_ptr(),
                packed.compensation.data_ptr(), packed.out_features, row_scales.data_ptr(), col_scales.data_ptr(),
                outliers, outlier_index.data_ptr(), outlier_value.data_ptr(),
                None if weight_t is None else weight_t.data_ptr()]

    def _refused(self, what: str, a: torch.Tensor, packed: PackedInt8) -> RuntimeError:
        return RuntimeError(f"the {what} refused a {tuple(a.shape)} x {packed.out_features} product ({self.isa} build)")

    def matmul_dequantize(self, a: torch.Tensor, packed: PackedInt8, row_scales: torch.Tensor,
                          col_scales: torch.Tensor, outlier_index: torch.Tensor, outlier_value: torch.Tensor,
                          weight_t: torch.Tensor | None, dtype: torch.dtype, bias: torch.Tensor | None = None,
                          residual: torch.Tensor | None = None) -> torch.Tensor:
        """`matmul`'s products turned into [M, out] fp32 or bf16 in the tiles' epilogue, the
        arithmetic of the separate dequantize pass (kernels/int8_rows.py `dequantize`, the
        same arguments): (products * row scale + the rows' outliers times their rows of
        `weight_t` [in, out]) * column scales (+ bias) (+ residual)."""
        arguments = self._epilogue_arguments(a, packed, row_scales, col_scales, outlier_index, outlier_value,
                                             weight_t, dtype)
        bias = None if bias is None else bias.to(dtype).contiguous()
        residual = None if residual is None else residual.to(dtype).contiguous()
        out = torch.empty(a.shape[0], packed.out_features, dtype=dtype)
        if self._gemm_dequantize(*arguments, None if bias is None else bias.data_ptr(),
                                 None if residual is None else residual.data_ptr(), out.data_ptr(), _OUT_KINDS[dtype],
                                 torch.get_num_threads()) != 0:
            raise self._refused("int8 GEMM", a, packed)
        return out

    def gated(self, a: torch.Tensor, packed: PackedInt8, row_scales: torch.Tensor, col_scales: torch.Tensor,
              outlier_index: torch.Tensor, outlier_value: torch.Tensor, weight_t: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
        """A gated MLP's middle: silu(gate) * up [M, intermediate] as fp32 holding `dtype`'s
        roundings, from a `pack_gate_up` matrix, computed in the tiles' epilogue as the
        separate passes do (kernels/int8_rows.py `gated_quantize` before its quantize step).
        col_scales, weight_t [in, 2 x intermediate] and the outliers are the unpacked
        matrix's (gate then up)."""
        arguments = self._epilogue_arguments(a, packed, row_scales, col_scales, outlier_index, outlier_value,
                                             weight_t, dtype)
        h = torch.empty(a.shape[0], packed.out_features // 2, dtype=torch.float32)
        if self._gemm_gated(*arguments, h.data_ptr(), _OUT_KINDS[dtype], torch.get_num_threads()) != 0:
            raise self._refused("gated int8 GEMM", a, packed)
        return h


def load_int8_gemm_kernel(cache_dir: Path) -> Int8GemmKernel | None:
    """The kernel where it builds with its VNNI path, else None (a warning says why where the
    build fails; a build without VNNI is no error: torch._int_mm serves)."""
    kernel = build_or_none(Int8GemmKernel.build, cache_dir, "the packed int8 GEMM",
                           "--quantization int8 multiplies through torch._int_mm")
    return kernel if kernel is not None and kernel.isa != "none" else None
