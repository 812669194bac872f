"""4-bit weights times a few activation rows, by integer dot products (csrc/q4_gemm.c).

A decode step's GEMMs have one or two rows: their time is the weight bytes they read, and a
4-bit matrix is a quarter of bf16's. PyTorch's CPU int4 kernel unpacks nibbles into floats
and ends up compute-bound (~9 GB/s of weights on the 2-core AVX-512 EPYC, one thread); this
kernel quantizes the activations per group of 32 and multiplies with integer dot products
(AVX-512 VNNI or AVX2), as llama.cpp does, but with 16-bit activations where llama.cpp
takes 8: the 8-bit rounding was all of the scheme's perplexity loss beyond the 4-bit
weights themselves (+1.45% on the default model in bf16), 16 bits are below bf16's own.

The C source is compiled on first use like the attention kernel (cpu_attention.py), for the
machine it runs on (`-march=native`: the VNNI path where the CPU has it, AVX2 or plain C
otherwise; `isa` says which). Without a compiler the caller falls back to torch's kernel.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.kernels.c_library import bind, build_kernel_library, build_or_none

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "q4_gemm.c"
GROUP = 32  # inputs sharing a scale and a minimum
BLOCK = 64  # inputs per 32 packed bytes: two groups, low and high nibbles
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class Q4Kernel:
    """The loaded C function."""

    def __init__(self, library: Path) -> None:
        gemm = (ctypes.c_int, [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int])
        functions = bind(library, {
            "tandem_q4_gemm": gemm, "tandem_q4_gemm_bf16": gemm, "tandem_q8_gemm": gemm,
            "tandem_q8_gemm_bf16": gemm, "tandem_q4_gemm_isa": (ctypes.c_char_p, []),
        })
        # (bits, activation dtype) -> entry
        self._gemms = {(bits, dtype): functions[f"tandem_q{bits}_gemm{suffix}"]
                       for bits in (4, 8) for dtype, suffix in ((torch.float32, ""), (torch.bfloat16, "_bf16"))}
        self.isa: str = functions["tandem_q4_gemm_isa"]().decode()

    def gemm_entry(self, bits: int, dtype: torch.dtype) -> object:
        """The C function for `bits`-bit levels and `dtype` activations (for callers in C)."""
        return self._gemms[bits, dtype]

    @classmethod
    def build(cls, cache_dir: Path) -> Q4Kernel:
        return cls(build_kernel_library(cache_dir, SOURCE))

    def gemm(self, matrix: Q4Matrix, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] fp32 or bf16, contiguous -> [M, N] in x's dtype (fp32 arithmetic), plus
        `residual` [M, N] (x's dtype, contiguous) where given."""
        rows = x.shape[0]
        out = torch.empty(rows, matrix.out_features, dtype=x.dtype)
        gemm = self._gemms[matrix.bits, x.dtype]
        status = gemm(matrix.nibbles.data_ptr(), matrix.scales.data_ptr(), matrix.mins.data_ptr(),
                      x.data_ptr(), None if residual is None else residual.data_ptr(), out.data_ptr(), rows,
                      matrix.out_features, matrix.in_features, torch.get_num_threads())
        if status != 0:
            raise MemoryError("the 4-bit GEMM could not allocate its scratch memory")
        return out


def load_q4_kernel(cache_dir: Path) -> Q4Kernel | None:
    """The kernel, or None (and a warning saying why) where it cannot be built here."""
    kernel = build_or_none(Q4Kernel.build, cache_dir, "4-bit GEMM kernel", "int4 weights use PyTorch's kernel")
    if kernel is not None:
        logger.info("4-bit GEMM kernel: %s", kernel.isa)
    return kernel


def q4_fits(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[1] % BLOCK == 0 and weight.device.type == "cpu"


@dataclass
class Q4Matrix:
    """A [N, K] matrix in the kernel's layout: per row, 32 bytes per 64 inputs (input j of a
    block in the low nibble of byte j, input j + 32 in its high nibble), and an fp16 scale
    and minimum per group of 32 inputs: weight = nibble * scale + minimum."""

    nibbles: torch.Tensor  # uint8 [N, K / 2]
    scales: torch.Tensor  # fp16 [N, K / 32]
    mins: torch.Tensor  # fp16 [N, K / 32]
    kernel: Q4Kernel
    bits = 4

    @property
    def out_features(self) -> int:
        return self.nibbles.shape[0]

    @property
    def in_features(self) -> int:
        return self.nibbles.shape[1] * 8 // self.bits

    @classmethod
    def quantize(cls, weight: torch.Tensor, kernel: Q4Kernel) -> Q4Matrix:
        """Round each group of 32 inputs to 16 levels spanning its own min..max."""
        if not q4_fits(weight):
            raise ValueError(f"the 4-bit kernel needs a CPU [out, in] matrix with in % {BLOCK} == 0, "
                             f"got {tuple(weight.shape)}")
        out_features, in_features = weight.shape
        groups = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)
        low = groups.amin(dim=-1, keepdim=True)
        scale = ((groups.amax(dim=-1, keepdim=True) - low) / 15).clamp_min(torch.finfo(torch.float16).tiny)
        # The fp16 scale and minimum are what the kernel reads: round against those.
        scale, low = scale.half().float(), low.half().float()
        levels = ((groups - low) / scale).round_().clamp_(0, 15).to(torch.uint8)
        pairs = levels.reshape(out_features, in_features // BLOCK, 2, GROUP)
        nibbles = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(out_features, in_features // 2)
        return cls(nibbles.contiguous(), scale.squeeze(-1).half().contiguous(), low.squeeze(-1).half().contiguous(),
                   kernel)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for x of shape [..., K], in x's dtype (the kernel works in fp32)."""
        rows = x.reshape(-1, x.shape[-1])
        rows = rows.contiguous() if rows.dtype == torch.bfloat16 else rows.float().contiguous()
        return self.kernel.gemm(self, rows).reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def matmul_plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """`residual + x @ W.T` in one call for 2-D fp32 or bf16 rows sharing residual's dtype
        (the sum rounded as torch's add would round it); None where the kernel cannot."""
        if x.dim() != 2 or x.dtype != residual.dtype or x.dtype not in (torch.float32, torch.bfloat16):
            return None
        return self.kernel.gemm(self, x.contiguous(), residual.contiguous())

    def dequantize(self) -> torch.Tensor:
        """The dense [N, K] fp32 matrix the nibbles stand for (for tests and checks)."""
        blocks = self.nibbles.reshape(self.out_features, -1, GROUP)
        levels = torch.stack([blocks & 0x0F, blocks >> 4], dim=2).reshape(self.out_features, -1, GROUP).float()
        dense = levels * self.scales.float().unsqueeze(-1) + self.mins.float().unsqueeze(-1)
        return dense.reshape(self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.nibbles, self.scales, self.mins))


class Q8Matrix(Q4Matrix):
    """The same scheme with 8 bits: one level byte per input (`nibbles` holds [N, K] levels),
    weight = level * scale + min, 256 levels per group of 32. For a matrix 4 bits would
    spoil: an LM head read whole at every token (SmolLM2's, 8 bits in its GGUF, lost 6.9%
    perplexity in 4 bits) reads half of bf16's bytes this way."""

    bits = 8

    @classmethod
    def quantize(cls, weight: torch.Tensor, kernel: Q4Kernel) -> Q8Matrix:
        """Symmetric per group: scale = max|w| / 127, levels 1..255 around 128 (min =
        -128 scale), so a Q8_0 tensor (whose groups all reach +-127 steps) comes back exactly."""
        if not q4_fits(weight):
            raise ValueError(f"the 8-bit kernel needs a CPU [out, in] matrix with in % {BLOCK} == 0, "
                             f"got {tuple(weight.shape)}")
        out_features, in_features = weight.shape
        groups = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)
        # fp16 subnormal scales too (the kernel widens them exactly): a group of tiny weights
        # keeps its 255 levels.
        scale = (groups.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(2.0**-24)
        scale = scale.half().float()
        levels = (groups / scale).round_().clamp_(-127, 127).add_(128).to(torch.uint8)
        return cls(levels.reshape(out_features, in_features).contiguous(), scale.squeeze(-1).half().contiguous(),
                   (scale.squeeze(-1) * -128).half().contiguous(), kernel)

    def dequantize(self) -> torch.Tensor:
        levels = self.nibbles.reshape(self.out_features, -1, GROUP).float()
        dense = levels * self.scales.float().unsqueeze(-1) + self.mins.float().unsqueeze(-1)
        return dense.reshape(self.out_features, self.in_features)
