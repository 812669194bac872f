"""tandem's fp32 and bf16 GEMM over weights packed once at load (csrc/dense_gemm.c), for
steps of many rows on CPUs with AVX-512, and fp32 on CPUs with AVX2 + FMA only.

oneDNN's packed fp32 and bf16 GEMMs, which both tandem's and vLLM's CPU linears call, run at
16-128 rows well under their large-step rate on the 2-core AVX-512 EPYC; the kernel keeps a
6-row by 64-column tile's accumulators in registers over the whole inner dimension, as the
packed int8 GEMM does (kernels/int8_gemm.py). With AMX, bf16 multiplies on the tiles from the
same packed blocks (csrc/dense_gemm_amx.h), so the fused epilogues and the layer stack's
batched steps, which need a C GEMM, run there too. On an AVX2-only CPU oneDNN's packed fp32
linear ran at 93-115 GFLOP/s at 64 rows on the 2-core EPYC, 72-80% of a decode-heavy step
(csrc/dense_gemm_avx2.h).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch

from tandem.kernels.c_library import bind, build_kernel_library, build_or_none
from tandem.platform.machine import best_rate

SOURCE = Path(__file__).parent / "csrc" / "dense_gemm.c"
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_PTR = ctypes.c_void_p
_KINDS = {torch.float32: 0, torch.bfloat16: 1}
KIND_BF16_W8 = 3  # bf16 rows, 8-bit weights (csrc/dense_gemm.c)
BLOCK_COLUMNS = 16  # output columns a packed block holds
W8_STEP = 32  # the 8-bit weights' inner dimension comes in AMX tile steps of 32


def _pointer(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


class PackedDense(NamedTuple):
    """An [out, in] matrix in the kernel's blocks (fp32: [out/16, in, 16]; bf16: [out/16,
    in/2, 16, 2]; 8-bit weights for bf16 rows: the bf16 blocks' order in int8 values, then one
    fp32 scale an output column, all in `values`)."""

    values: torch.Tensor
    in_features: int
    out_features: int

    @property
    def rows_dtype(self) -> torch.dtype:
        """The dtype of the rows it multiplies (and of its products)."""
        return torch.bfloat16 if self.values.dtype == torch.int8 else self.values.dtype

    @property
    def kind(self) -> int:
        """The C kernel's kind for this matrix."""
        return KIND_BF16_W8 if self.values.dtype == torch.int8 else _KINDS[self.values.dtype]

    def weight(self) -> torch.Tensor:
        """The matrix back as [out, in] (torch ops; for tests): 8-bit values times their scales
        in fp32."""
        blocks = self.out_features // BLOCK_COLUMNS
        if self.values.dtype == torch.int8:
            count = self.out_features * self.in_features
            scales = self.values[count:].view(torch.float32)
            pairs = self.values[:count].reshape(blocks, self.in_features // 2, BLOCK_COLUMNS, 2)
            levels = pairs.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features)
            return levels.float() * scales.unsqueeze(1)
        if self.values.dtype == torch.float32:
            return self.values.reshape(blocks, self.in_features, BLOCK_COLUMNS).permute(0, 2, 1).reshape(
                self.out_features, self.in_features)
        pairs = self.values.reshape(blocks, self.in_features // 2, BLOCK_COLUMNS, 2)
        return pairs.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features)


class DenseGemmKernel:
    """The loaded C functions, called on tensors' data pointers."""

    def __init__(self, library: Path) -> None:
        functions = bind(library, {
            "tandem_dense_pack": (None, [_PTR, _INT, _I64, _I64, _PTR, _INT]),
            "tandem_dense_gemm": (_INT, [_PTR, _I64, _I64, _I64, _PTR, _INT, _PTR, _PTR, _PTR, _I64, _INT]),
            "tandem_dense_gemm_silu_mul": (_INT, [_PTR, _I64, _I64, _I64, _PTR, _INT, _PTR, _PTR, _I64, _INT]),
            "tandem_dense_gemm_argmax": (_INT, [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _INT]),
            "tandem_dense_gemm_isa": (ctypes.c_char_p, []),
        })
        self._silu_mul = functions["tandem_dense_gemm_silu_mul"]
        self._argmax = functions["tandem_dense_gemm_argmax"]
        self._pack = functions["tandem_dense_pack"]
        self._gemm = functions["tandem_dense_gemm"]
        self.isa: str = functions["tandem_dense_gemm_isa"]().decode()  # "amx-bf16", "avx512-bf16", "avx512", "avx2", "none"

    # The C functions themselves, for callers in C (tandem/kernels/decode_stack.py).
    def gemm_entry(self) -> object:
        return self._gemm

    def silu_mul_entry(self) -> object:
        return self._silu_mul

    @classmethod
    def build(cls, cache_dir: Path) -> DenseGemmKernel:
        return cls(build_kernel_library(cache_dir, SOURCE))

    def multiplies(self, dtype: torch.dtype) -> bool:
        bf16 = self.isa in ("amx-bf16", "avx512-bf16")
        return (dtype == torch.float32 and self.isa != "none") or (dtype == torch.bfloat16 and bf16)

    def fits(self, weight: torch.Tensor, bits: int = 16) -> bool:
        """Whether this [out, in] matrix can be packed and multiplied here (bits 8: as 8-bit
        weights for bf16 rows, AMX's tiles only, `in` a multiple of 32)."""
        out_features, in_features = weight.shape
        if bits == 8:
            return (weight.dim() == 2 and weight.device.type == "cpu" and self.isa == "amx-bf16"
                    and weight.dtype == torch.bfloat16 and out_features % BLOCK_COLUMNS == 0 and out_features > 0
                    and in_features > 0 and in_features % W8_STEP == 0)
        return (weight.dim() == 2 and weight.device.type == "cpu" and self.multiplies(weight.dtype)
                and out_features % BLOCK_COLUMNS == 0 and out_features > 0 and in_features > 0
                and (weight.dtype == torch.float32 or in_features % 2 == 0))

    def pack(self, weight: torch.Tensor, bits: int = 16) -> PackedDense:
        """[out, in] fp32 or bf16 -> the packed matrix (the same dtype); bits 8: a bf16 matrix
        -> its 8-bit weights (`pack_8bit`)."""
        if bits == 8:
            return self.pack_8bit(weight)
        if not self.fits(weight):
            raise ValueError(f"the dense GEMM packs CPU [out, in] matrices with out % 16 == 0 (in even for bf16) in "
                             f"a dtype it multiplies ({self.isa} build), got {tuple(weight.shape)} {weight.dtype}")
        weight = weight.detach().contiguous()
        values = torch.empty_like(weight)
        self._pack(weight.data_ptr(), _KINDS[weight.dtype], weight.shape[0], weight.shape[1], values.data_ptr(),
                   torch.get_num_threads())
        return PackedDense(values, weight.shape[1], weight.shape[0])

    def pack_8bit(self, weight: torch.Tensor) -> PackedDense:
        """A bf16 [out, in] matrix -> 8-bit weights for bf16 rows (W8A16): each output row
        rounded to int8 with one fp32 scale (its largest magnitude / 127, symmetric, to
        nearest), in the bf16 blocks' order, the scales after the values."""
        if not self.fits(weight, bits=8):
            raise ValueError(f"8-bit weights need AMX's tiles and a bf16 CPU [out, in] matrix with out % 16 == 0 and "
                             f"in % {W8_STEP} == 0 ({self.isa} build), got {tuple(weight.shape)} {weight.dtype}")
        out_features, in_features = weight.shape
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp_min_(1e-12).div_(127.0)
        levels = torch.round(w / scales.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
        blocks = levels.reshape(out_features // BLOCK_COLUMNS, BLOCK_COLUMNS, in_features // 2, 2)
        packed = blocks.permute(0, 2, 1, 3).reshape(-1)
        values = torch.cat([packed, scales.contiguous().view(torch.int8)])
        return PackedDense(values, in_features, out_features)

    def pack_gated(self, gate_up: torch.Tensor, bits: int = 16) -> PackedDense:
        """A gated MLP's [2 x intermediate, in] gate-then-up matrix -> packed with its blocks
        alternating gate and up (the same 16 intermediate columns each pair), for
        `silu_mul`. `out_features` is 2 x intermediate; `weight()` gives the interleaved rows."""
        rows, in_features = gate_up.shape
        if rows % (2 * BLOCK_COLUMNS) != 0:
            raise ValueError(f"a gate/up matrix of 2 x intermediate rows, intermediate % 16 == 0, got {rows}")
        halves = gate_up.detach().reshape(2, rows // (2 * BLOCK_COLUMNS), BLOCK_COLUMNS, in_features)
        return self.pack(halves.transpose(0, 1).reshape(rows, in_features), bits)

    def silu_mul(self, x: torch.Tensor, packed: PackedDense, bias: torch.Tensor | None = None) -> torch.Tensor:
        """silu(x @ gate.T (+ gate bias)) * (x @ up.T (+ up bias)) -> [M, intermediate] from a
        `pack_gated` matrix, in its dtype, computed in fp32 and rounded once. `bias` is the
        layer's [2 x intermediate] (gate's then up's)."""
        dtype = self._check_rows(x, packed)
        bias = None if bias is None else bias.to(dtype).contiguous()
        intermediate = packed.out_features // 2
        out = torch.empty(x.shape[0], intermediate, dtype=dtype)
        status = self._silu_mul(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], packed.values.data_ptr(),
                                packed.kind, _pointer(bias), out.data_ptr(), intermediate, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"the gated dense GEMM refused a {tuple(x.shape)} {dtype} product ({self.isa} build)")
        return out

    @staticmethod
    def _check_rows(x: torch.Tensor, packed: PackedDense) -> torch.dtype:
        dtype = packed.rows_dtype
        if x.dim() != 2 or x.dtype != dtype or x.stride(1) != 1 or x.shape[1] != packed.in_features:
            raise ValueError(f"{dtype} rows [M, {packed.in_features}] with a dense last dimension expected, got "
                             f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
        return dtype

    def matmul(self, x: torch.Tensor, packed: PackedDense, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in] (rows dense) @ W.T (+ bias) (+ residual) -> [M, out], all in the weight's
        dtype, rounded once at the end."""
        dtype = self._check_rows(x, packed)
        rows, in_features = x.shape
        bias = None if bias is None else bias.to(dtype).contiguous()
        residual = None if residual is None else residual.to(dtype).contiguous()
        out = torch.empty(rows, packed.out_features, dtype=dtype)
        status = self._gemm(x.data_ptr(), x.stride(0), rows, in_features, packed.values.data_ptr(), packed.kind,
                            _pointer(bias), _pointer(residual), out.data_ptr(), packed.out_features,
                            torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"the dense GEMM refused a [{rows}, {in_features}] {dtype} product ({self.isa} build)")
        return out

    def argmax(self, x: torch.Tensor, packed: PackedDense) -> torch.Tensor | None:
        """Each row's argmax of `matmul(x, packed)` (int64 [M]): the first of equal maxima, or the
        first NaN, as torch.argmax gives it over the bf16 product, without writing the product.
        A greedy LM head's: 64 rows of SmolLM2's 49,152 logits are 6 MiB written, then read
        again by the argmax. None where this build does not (bf16 on AMX's tiles only, K a
        multiple of 32): the caller multiplies, then takes the argmax."""
        if packed.values.dtype != torch.bfloat16 or self.isa != "amx-bf16" or packed.in_features % 32:
            return None
        self._check_rows(x, packed)
        ids = torch.empty(x.shape[0], dtype=torch.int64)
        status = self._argmax(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], packed.values.data_ptr(),
                              packed.out_features, ids.data_ptr(), torch.get_num_threads())
        return ids if status == 0 else None


def packed_gemm_flops_per_s(kernel: DenseGemmKernel, dtype: torch.dtype, m: int, k: int, n: int,
                            repeats: int = 5) -> float:
    """FLOP/s of this kernel's [m, k] x [k, n] product in `dtype` on torch's threads (0.0 where
    it does not multiply the dtype): on an AMX CPU it passes oneDNN's packed linear, so a
    machine's matmul ceiling that left it out read tandem's linears as faster than the box."""
    if not kernel.multiplies(dtype) or n % BLOCK_COLUMNS or (dtype == torch.bfloat16 and k % 2):
        return 0.0
    packed = kernel.pack(torch.randn(n, k).to(dtype))
    x = torch.randn(m, k).to(dtype)
    return best_rate(lambda: kernel.matmul(x, packed), 2 * m * k * n, repeats)


def load_dense_gemm_kernel(cache_dir: Path) -> DenseGemmKernel | None:
    """The kernel where it builds with a vector path, else None."""
    kernel = build_or_none(DenseGemmKernel.build, cache_dir, "the packed dense GEMM",
                           "linear layers multiply through oneDNN's packed GEMM")
    return kernel if kernel is not None and kernel.isa != "none" else None
