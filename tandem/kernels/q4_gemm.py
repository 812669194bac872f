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
LEVEL_BITS = (4, 5, 8)  # the level widths the kernel reads
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class Q4Kernel:
    """The loaded C function."""

    def __init__(self, library: Path) -> None:
        gemm = (ctypes.c_int, [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int])
        scaled = (ctypes.c_int, [_PTR, _PTR, _PTR, ctypes.c_int, _PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int])
        moe = (ctypes.c_int, [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, ctypes.c_int, _PTR, _PTR, _PTR, _I64, _I64, _I64,
                              ctypes.c_int])
        functions = bind(library, {
            **{f"tandem_q{bits}_gemm{suffix}": gemm for bits in LEVEL_BITS for suffix in ("", "_bf16")},
            "tandem_q4_gemm_isa": (ctypes.c_char_p, []),
            "tandem_q4_gemm_scaled": scaled, "tandem_q4_moe": moe,
        })
        self._scaled = functions["tandem_q4_gemm_scaled"]
        self._moe = functions["tandem_q4_moe"]
        # (bits, activation dtype) -> entry
        self._gemms = {(bits, dtype): functions[f"tandem_q{bits}_gemm{suffix}"]
                       for bits in LEVEL_BITS for dtype, suffix in ((torch.float32, ""), (torch.bfloat16, "_bf16"))}
        self.isa: str = functions["tandem_q4_gemm_isa"]().decode()

    def gemm_entry(self, bits: int, dtype: torch.dtype) -> object:
        """The C function for `bits`-bit levels (4, 5 or 8) and `dtype` activations (for callers in C)."""
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
        status = gemm(matrix.nibbles.data_ptr(), matrix.scales.data_ptr(), _pointer(matrix.mins),
                      x.data_ptr(), None if residual is None else residual.data_ptr(), out.data_ptr(), rows,
                      matrix.out_features, matrix.in_features, torch.get_num_threads())
        if status != 0:
            raise MemoryError("the 4-bit GEMM could not allocate its scratch memory")
        return out


    def gemm_scaled(self, nibbles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                    x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 @ W.T for a 4-bit W [N, K] in the kernel's layout whose scales (and
        mins) are fp16 or bf16, with no mins for symmetric levels (weight = (nibble - 8) *
        scale)."""
        rows, n = x.shape[0], nibbles.shape[0]
        _check_scales(scales, mins)
        out = torch.empty(rows, n, dtype=torch.float32)
        status = self._scaled(nibbles.data_ptr(), scales.data_ptr(), None if mins is None else mins.data_ptr(),
                              int(scales.dtype == torch.bfloat16), x.data_ptr(), None, out.data_ptr(), rows, n,
                              x.shape[1], torch.get_num_threads())
        if status != 0:
            raise MemoryError("the 4-bit GEMM could not allocate its scratch memory")
        return out

    def moe(self, experts: Q4ExpertStack, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """A MoE layer's routed experts on x [M, hidden] fp32 (contiguous), rows sorted by
        expert (expert e's are offsets[e] .. offsets[e + 1], int64 [E + 1]): each row's
        down(silu(gate x) * up x) in one call, [M, hidden] fp32."""
        out = torch.empty(x.shape[0], experts.hidden, dtype=torch.float32)
        status = self._moe(
            experts.w13.data_ptr(), experts.s13.data_ptr(), _pointer(experts.m13), experts.w2.data_ptr(),
            experts.s2.data_ptr(), _pointer(experts.m2), int(experts.s13.dtype == torch.bfloat16), x.data_ptr(),
            offsets.data_ptr(), out.data_ptr(), experts.num_experts, experts.hidden, experts.inter,
            torch.get_num_threads())
        if status != 0:
            raise MemoryError("the 4-bit expert GEMMs could not allocate their scratch memory")
        return out


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _check_scales(scales: torch.Tensor, mins: torch.Tensor | None) -> None:
    if scales.dtype not in (torch.float16, torch.bfloat16) or (mins is not None and mins.dtype != scales.dtype):
        raise TypeError(f"4-bit scales and mins must be fp16 or bf16 alike, got {scales.dtype} "
                        f"and {None if mins is None else mins.dtype}")


@dataclass
class Q4ExpertStack:
    """A MoE layer's routed experts in the kernel's 4-bit layout, stacked: w13 [E, 2I, H/2]
    nibbles (gate rows, then up rows) and w2 [E, H, I/2], with per-group scales s13 [E, 2I,
    H/32] and s2 [E, H, I/32] (fp16 or bf16) and minimums m13 / m2 alike, or None where the
    levels are symmetric (weight = (nibble - 8) * scale, as compressed-tensors INT4)."""

    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    m13: torch.Tensor | None = None
    m2: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def inter(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    def check(self) -> None:
        """Shapes, dtypes and contiguity the C function relies on (it reads raw pointers)."""
        e, wide, hidden = self.num_experts, 2 * self.inter, self.hidden
        expected = {"w13": (e, wide, hidden // 2), "s13": (e, wide, hidden // GROUP),
                    "w2": (e, hidden, self.inter // 2), "s2": (e, hidden, self.inter // GROUP)}
        for name, shape in expected.items():
            tensor = getattr(self, name)
            if tuple(tensor.shape) != shape or not tensor.is_contiguous():
                raise ValueError(f"4-bit experts: {name} is {tuple(tensor.shape)}, expected contiguous {shape}")
        if hidden % BLOCK or self.inter % BLOCK:
            raise ValueError(f"4-bit experts need hidden and intermediate sizes divisible by {BLOCK}, "
                             f"got {hidden} and {self.inter}")
        for name in ("w13", "w2"):
            if getattr(self, name).dtype != torch.uint8:
                raise TypeError(f"4-bit experts: {name} must be uint8 nibbles")
        _check_scales(self.s13, self.m13)
        _check_scales(self.s2, self.m2)


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
    mins: torch.Tensor | None  # fp16 [N, K / 32]; None: symmetric levels (Q8Matrix)
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
        return sum(t.numel() * t.element_size() for t in (self.nibbles, self.scales, self.mins) if t is not None)


class Q8Matrix(Q4Matrix):
    """8 bits, symmetric: one signed level byte per input (`nibbles` holds [N, K] int8 levels
    as uint8), weight = level * scale, no minimums (`mins` None: they were a ninth of the
    bytes a one-row step reads). For a matrix 4 bits would spoil: an LM head read whole at
    every token (SmolLM2's, 8 bits in its GGUF, lost 6.9% perplexity in 4 bits) reads half
    of bf16's bytes this way, and a 5- or 6-bit GGUF's layers (Qwen2.5-Coder-0.5B's) too."""

    bits = 8

    @classmethod
    def quantize(cls, weight: torch.Tensor, kernel: Q4Kernel) -> Q8Matrix:
        """Symmetric per group: scale = max|w| / 127, levels -127..127, so a Q8_0 tensor
        (whose groups all reach +-127 steps) comes back exactly."""
        if not q4_fits(weight):
            raise ValueError(f"the 8-bit kernel needs a CPU [out, in] matrix with in % {BLOCK} == 0, "
                             f"got {tuple(weight.shape)}")
        out_features, in_features = weight.shape
        groups = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)
        # fp16 subnormal scales too (the kernel widens them exactly): a group of tiny weights
        # keeps its 255 levels.
        scale = (groups.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(2.0**-24)
        scale = scale.half().float()
        levels = (groups / scale).round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
        return cls(levels.reshape(out_features, in_features).contiguous(), scale.squeeze(-1).half().contiguous(),
                   None, kernel)

    def dequantize(self) -> torch.Tensor:
        levels = self.nibbles.view(torch.int8).reshape(self.out_features, -1, GROUP).float()
        dense = levels * self.scales.float().unsqueeze(-1)
        return dense.reshape(self.out_features, self.in_features)


class Q5Matrix(Q4Matrix):
    """5 bits, symmetric, GGUF's Q5_0 grid: per 64 inputs, the 4-bit layout's 32 nibble bytes
    and then 8 bytes holding each input's fifth bit (bit j of the little-endian word: input j),
    so `nibbles` is [N, K * 5 / 8] bytes; levels q + 16 for q in -16..15, weight = q * scale,
    no minimums. For a GGUF's Q5_0 matrices (most of Qwen2.5-Coder's layers), which an 8-bit
    copy reads at 1.06 bytes a weight and still rounds off their grid (~0.5% relative error),
    while 5 bits hold them exactly in 0.69."""

    bits = 5

    @classmethod
    def quantize(cls, weight: torch.Tensor, kernel: Q4Kernel) -> Q5Matrix:
        """Q5_0's rule: the group's largest magnitude w sets scale = w / -16 (so a Q5_0 tensor
        comes back exactly: its quantizer put that weight on level -16), then one least-squares
        refit of the scale to the rounded levels, which can only bring the group closer (a
        checkpoint rounded to bf16 since its Q5_0 days: 0.20% -> 0.15% relative error)."""
        if not q4_fits(weight):
            raise ValueError(f"the 5-bit kernel needs a CPU [out, in] matrix with in % {BLOCK} == 0, "
                             f"got {tuple(weight.shape)}")
        out_features, in_features = weight.shape
        groups = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)
        largest = groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True))
        scale = _fp16_scale(largest / -16)
        levels = (groups / scale).round_().clamp_(-16, 15)
        squares = (levels * levels).sum(-1, keepdim=True)
        fitted = _fp16_scale((groups * levels).sum(-1, keepdim=True) / squares.clamp_min(1))
        scale = torch.where(squares > 0, fitted, scale)
        levels = (groups / scale).round_().clamp_(-16, 15).add_(16).to(torch.uint8)
        blocks = levels.reshape(out_features, in_features // BLOCK, 2, GROUP)
        nibbles = (blocks[:, :, 0] & 0x0F) | ((blocks[:, :, 1] & 0x0F) << 4)
        fifth = (blocks >> 4).reshape(out_features, in_features // BLOCK, 8, 8)  # input 8 i + j's bit
        high = (fifth << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)  # disjoint bits
        packed = torch.cat([nibbles, high], dim=-1).reshape(out_features, in_features * 5 // 8)
        return cls(packed.contiguous(), scale.squeeze(-1).half().contiguous(), None, kernel)

    def dequantize(self) -> torch.Tensor:
        blocks = self.nibbles.reshape(self.out_features, -1, BLOCK * 5 // 8)
        nibbles, high = blocks[..., :GROUP], blocks[..., GROUP:]
        low = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=2).reshape(self.out_features, -1, BLOCK)
        fifth = ((high.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(self.out_features, -1, BLOCK)
        levels = (low | (fifth << 4)).reshape(self.out_features, -1, GROUP).float().sub_(16)
        dense = levels * self.scales.float().unsqueeze(-1)
        return dense.reshape(self.out_features, self.in_features)


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """A per-group scale as the kernel reads it: fp16, never zero (subnormals included: the
    kernel widens them exactly), within fp16's range."""
    magnitude = scale.abs().clamp(2.0**-24, 65504.0)
    return torch.where(scale < 0, -magnitude, magnitude).half().float()
