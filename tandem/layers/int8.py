"""8-bit weights times 8-bit activations (W8A8) for steps of many tokens: VNNI's integer dot
products do twice the multiply-adds of bf16's per instruction.

A prefill chunk or a large decode batch is compute-bound: on the 2-core AVX-512 EPYC oneDNN's
bf16 GEMM runs at ~410 GFLOP/s for the default model's shapes, its int8 GEMM (reached through
`torch._int_mm`) at ~790-830 GOP/s from 32 rows up. Each output row of a weight matrix keeps
one scale (symmetric, round to nearest, -127..127); each input row is quantized on the fly
with a scale of its own (its largest magnitude / 127), so a row's result depends on that row
alone, as in a dense GEMM: a one-token step computes exactly what the same token in a prefill
chunk gets. The int32 products come back as `acc * row_scale * column_scale`.

Outliers: a per-token scale alone is coarse where a token has outlier channels (the input of
SmolLM2's down projection reaches 100x its median): with it, `tandem bench perplexity` put the
mode at +2.5% over 3,700 tokens on the default model. So each row's few largest magnitudes
(`OUTLIER_CHANNELS`, chosen per row on the fly, as LLM.int8() splits off outlier features but
with no calibration) are taken out before its scale is set and added back exactly, times the
int8 weight columns they meet (rows of the stored [in, out] matrix, one per outlier).
Four per row bring the mode within 0.6% of fp32 (README, Performance).

The passes around the GEMM (quantizing the input, dequantizing with the bias and the
residual add folded in) run in C (kernels/int8_rows.py) where it
builds; the torch ops below do the same arithmetic where it does not.

The GEMM itself: tandem's own over weights packed once (kernels/int8_gemm.py: AMX's int8
tiles, or VNNI's vpdpbusd) where the CPU has VNNI and the C passes run, else `torch._int_mm`. Both give the same int32
products, so the two are interchangeable bit for bit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tandem.kernels.int8_gemm import BLOCK_COLUMNS, Int8GemmKernel, PackedInt8
from tandem.kernels.int8_rows import Int8RowsKernel, QuantizedRows
from tandem.platform.machine import best_rate

_EPSILON = 1e-12
# Each activation row's largest magnitudes kept exact. On the default model, 3,700 tokens in
# 64-token chunks against fp32 (an ad-hoc sweep through the torch path): none +2.5%, 4 per row
# -0.01% in fp32 and +0.13% in bf16, 8 +0.03%, 16 +0.16%.
OUTLIER_CHANNELS = 4


def int8_available() -> bool:
    return hasattr(torch, "_int_mm")


# 1024 * 127 * 127 < 2**24: every partial sum of a K-slice this long is an integer fp32 holds exactly
_EXACT_FP32_SLICE = 1024


@functools.cache
def _native_int_mm() -> bool:
    """Whether torch's integer GEMM has a fast kernel on this CPU. On an AVX2-only EPYC
    `torch._int_mm` ran at ~1.4 GOP/s (a scalar loop), 15x under its fp32 GEMM; the AVX-512
    boxes reach oneDNN's int8 GEMM (~800 GOP/s)."""
    return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2")


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] int8 @ b [K, N] int8 -> int32 [M, N], bit for bit torch._int_mm's. Where that
    has no fast kernel, fp32 GEMMs over K-slices short enough that every partial sum is
    exact, summed in int32 (the 2-core AVX2 EPYC: 18 GOP/s at 64 rows, against 1.4)."""
    if _native_int_mm():
        return torch._int_mm(a, b)
    out: torch.Tensor | None = None
    for start in range(0, a.shape[1], _EXACT_FP32_SLICE):
        end = start + _EXACT_FP32_SLICE
        part = (a[:, start:end].float() @ b[start:end].float()).to(torch.int32)
        out = part if out is None else out.add_(part)
    assert out is not None, "an empty inner dimension"
    return out


def int8_fits(weight: torch.Tensor) -> bool:
    """Whether `torch._int_mm` takes this [out, in] matrix (it wants multiples of 8)."""
    return (weight.dim() == 2 and weight.shape[0] % 8 == 0 and weight.shape[1] % 8 == 0
            and weight.device.type == "cpu")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of a float matrix to int8 with its own scale: (int8 [M, K], fp32 scales [M, 1])."""
    x = x.float()
    scales = x.abs().amax(dim=1, keepdim=True).clamp_min_(_EPSILON).div_(127.0)
    # times the reciprocal, as the C kernel does, so both round every value the same way
    return torch.round(x * scales.reciprocal()).to(torch.int8), scales


def quantize_rows_with_outliers(x: torch.Tensor, outliers: int) -> QuantizedRows:
    """`quantize_rows` after each row's `outliers` largest magnitudes are set aside (the C
    pass's arithmetic, as torch ops)."""
    x = x.float()
    index = x.abs().topk(min(outliers, x.shape[1]), dim=1).indices
    value = x.gather(1, index)
    values, scales = quantize_rows(x.scatter(1, index, 0.0))
    return QuantizedRows(values, scales, index.to(torch.int32), value)


@dataclass
class Int8Weight:
    """A [out, in] matrix as int8 with one fp32 scale per output row.

    `columns`, the matrix as [in, out], contiguous, is always kept: its rows are the ones an
    input row's outliers meet (read by the dequantize passes, 4 rows a token), and it is the
    layout `torch._int_mm` reads fastest (SmolLM2's 121 projections of a 64-sequence step:
    15.1 ms against 18.3 ms through the transposed [out, in] matrix, the same integers; 20-25%
    faster at 8-32 rows, even from 512 rows up, on the 2-core AVX-512 EPYC).

    `packed`, where tandem's GEMM runs (kernels/int8_gemm.py: VNNI, AMX's tiles too) and the C
    passes too: the same matrix in that GEMM's blocks, which the products then come from. The
    passes still read the outliers' rows from `columns`: read from the blocks, where a row's
    16-column pieces lie a panel apart, they took longer than the GEMM saved (64 sequences of
    SmolLM2: 5.7-6.4 s for a decode-heavy run became 6.9 s).
    """

    columns: torch.Tensor  # int8 [in, out], contiguous
    scales: torch.Tensor  # fp32 [out]
    kernel: Int8RowsKernel | None = None
    outliers: int = OUTLIER_CHANNELS  # each input row's largest magnitudes kept exact
    packed: PackedInt8 | None = None
    gemm: Int8GemmKernel | None = None  # set with `packed`
    # `packed` holds a gated MLP's gate and up blocks alternating (Int8GemmKernel.pack_gate_up):
    # only `gated_mlp` multiplies by it; the plain products come from `columns`.
    gate_up_pairs: bool = False

    @classmethod
    def quantize(cls, weight: torch.Tensor, kernel: Int8RowsKernel | None = None,
                 outliers: int = OUTLIER_CHANNELS, gemm: Int8GemmKernel | None = None,
                 gate_up: bool = False) -> Int8Weight:
        """`weight` [out, in] rounded to int8 per output row; packed for `gemm` too where it
        and the C passes (`kernel`) take the shape. `gate_up`: a gated MLP's gate then up
        rows, packed as pairs for `gated_mlp` where the GEMM and the passes' vector build take
        them (a projection with no bias and no tensor-parallel split: what gated_mlp runs)."""
        if not int8_fits(weight):
            raise ValueError(f"int8 needs a CPU [out, in] matrix with both sizes multiples of 8, got {tuple(weight.shape)}")
        values, scales = quantize_rows(weight.detach())
        columns = values.t().contiguous()
        use_gemm = gemm is not None and kernel is not None and gemm.fits(*columns.shape)
        pairs = (use_gemm and gate_up and kernel is not None and kernel.isa == "avx512"
                 and columns.shape[1] % (2 * BLOCK_COLUMNS) == 0)
        packed = None if not use_gemm else gemm.pack_gate_up(columns) if pairs else gemm.pack(columns)
        return cls(columns, scales.squeeze(1).contiguous(), kernel, outliers, packed, gemm if use_gemm else None,
                   pairs)

    @property
    def out_features(self) -> int:
        return self.columns.shape[1]

    @property
    def nbytes(self) -> int:
        return self.columns.numel() + self._packed_nbytes() + self.scales.numel() * 4

    @property
    def read_nbytes(self) -> int:
        """The bytes one product reads: the GEMM's packed blocks where it has them (a gated
        MLP's pairs included: `gated_mlp` reads those), else the columns; and the scales."""
        return (self._packed_nbytes() if self.packed is not None else self.columns.numel()) + self.scales.numel() * 4

    def _packed_nbytes(self) -> int:
        return 0 if self.packed is None else self.packed.values.numel() + self.packed.compensation.numel() * 4

    def dequantize(self) -> torch.Tensor:
        """The matrix as fp32 [out, in]."""
        return self.columns.t().float() * self.scales.unsqueeze(1)

    def products(self, values: torch.Tensor) -> torch.Tensor:
        """int8 rows [M, in] @ the int8 matrix -> int32 [M, out], from the packed GEMM where
        this matrix has it (the same integers)."""
        if self.packed is not None and not self.gate_up_pairs:
            assert self.gemm is not None, "a packed matrix comes with its GEMM"
            return self.gemm.matmul(values, self.packed)
        return int_mm(values, self.columns)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, in] (any float dtype) -> x @ W.T (+ bias) (+ residual), [M, out] in `dtype`
        (default x's: the LM head asks for fp32 logits straight from the integer products)."""
        dtype = dtype or x.dtype
        kernel = self.kernel
        if kernel is not None and kernel.takes(x, self.out_features) and dtype in (torch.float32, x.dtype):
            return self.matmul_rows(kernel.quantize_rows(x, self.outliers), dtype, bias, residual)
        rows = quantize_rows_with_outliers(x, self.outliers)
        out = self.products(rows.values).float() * rows.scales
        if self.outliers:
            met = self.columns[rows.outlier_index.long()].float()  # [M, outliers, out]
            out = out + torch.einsum("mj,mjn->mn", rows.outlier_value, met)
        out = (out * self.scales).to(dtype)
        out = out if bias is None else out + bias
        return out if residual is None else residual + out

    def matmul_rows(self, rows: QuantizedRows, dtype: torch.dtype, bias: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
        """`matmul` of rows already quantized (with this matrix's outlier count), through the
        kernel: [M, out] in dtype."""
        assert self.kernel is not None, "quantized rows come from the C kernel"
        if self.packed is not None and not self.gate_up_pairs:  # the dequantize step in the GEMM's epilogue
            assert self.gemm is not None, "a packed matrix comes with its GEMM"
            return self.gemm.matmul_dequantize(rows.values, self.packed, rows.scales, self.scales, rows.outlier_index,
                                               rows.outlier_value, self.columns, dtype, bias, residual)
        return self.kernel.dequantize(self.products(rows.values), rows, self.scales, self.columns, dtype, bias,
                                      residual)


def gated_mlp(gate_up: Int8Weight, down: Int8Weight, x: torch.Tensor, residual: torch.Tensor | None,
              down_bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """residual + down(silu(gate) * up) for x [M, hidden], both projections in 8 bits and the
    middle (dequantize the gate/up products, silu-and-mul, quantize for the down projection)
    one C pass; None where the kernel does not take these rows (the caller runs the
    projections one by one). The same arithmetic as the unfused path, silu's exp aside (two
    polynomials, csrc/avx512_math.h here and csrc/layer_ops.c there, may differ in the last
    bit)."""
    kernel = gate_up.kernel
    # the plain-C build calls expf a value at a time: slower there than the separate passes
    if (kernel is None or down.kernel is None or kernel.isa != "avx512"
            or not kernel.takes(x, gate_up.out_features)):
        return None
    rows = kernel.quantize_rows(x, gate_up.outliers)
    if gate_up.gate_up_pairs:  # the middle in the GEMM's epilogue, then quantized: the same bits
        assert gate_up.gemm is not None and gate_up.packed is not None
        h = gate_up.gemm.gated(rows.values, gate_up.packed, rows.scales, gate_up.scales, rows.outlier_index,
                               rows.outlier_value, gate_up.columns, x.dtype)
        middle = kernel.quantize_rows(h, down.outliers)
    else:
        middle = kernel.gated_quantize(gate_up.products(rows.values), rows, gate_up.scales, gate_up.columns,
                                       x.dtype, down.outliers)
    return down.matmul_rows(middle, x.dtype, down_bias, residual)


def int8_linear_flops_per_s(m: int, k: int, n: int, dtype: torch.dtype, kernel: Int8RowsKernel | None,
                            gemm: Int8GemmKernel | None, repeats: int = 5) -> float:
    """FLOP/s (two a multiply-add) of an 8-bit linear, rows [m, k] in `dtype` times an [n, k]
    matrix, all of `Int8Weight.matmul` timed: the rows' quantization, the integer products
    and the dequantize. The bench's matmul limit for a mode whose larger steps multiply in 8
    bits (`--quantization int8`): on VNNI an int8 product costs half a bf16 one, so a limit at
    the bf16 rate read such a mode past 100%."""
    weight = Int8Weight.quantize(torch.randn(n, k), kernel, gemm=gemm)
    x = torch.randn(m, k).to(dtype)
    return best_rate(lambda: weight.matmul(x), 2 * m * k * n, repeats)
