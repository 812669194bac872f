"""8-bit weights times 8-bit activations (W8A8) for steps of many tokens: VNNI's integer dot
products do twice the multiply-adds of bf16's per instruction.

A prefill chunk or a large decode batch is compute-bound: on the 2-core AVX-512 EPYC oneDNN's
bf16 GEMM runs at ~410 GFLOP/s for the default model's shapes, its int8 GEMM (reached through
`torch._int_mm`) at ~790-830 GOP/s from 32 rows up. Each output row of a weight matrix keeps
one scale (symmetric, round to nearest, -127..127); each input row is quantized on the fly
with a scale of its own (its largest magnitude / 127), so a row's result depends on that row
alone, as in a dense GEMM: a one-token step computes exactly what the same token in a prefill
chunk gets. The int32 products come back as `acc * row_scale * column_scale`.

Quality: a per-token scale is coarse where a token has outlier channels (the input of
SmolLM2's down projection reaches 100x its median), and `tandem bench perplexity` puts the mode
at +2.5% over 3,700 tokens on the default model, outside the 1% that the exact-quality modes
keep; it is a speed mode, to be chosen knowingly.

The passes around the GEMM (quantizing the input, dequantizing with the bias and the
residual add folded in) run in C (kernels/int8_rows.py) where it
builds; the torch ops below do the same arithmetic where it does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels.int8_rows import Int8RowsKernel

_EPSILON = 1e-12


def int8_available() -> bool:
    return hasattr(torch, "_int_mm")


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


@dataclass
class Int8Weight:
    """A [out, in] matrix as int8 with one fp32 scale per output row."""

    values: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # fp32 [out]
    kernel: Int8RowsKernel | None = None

    @classmethod
    def quantize(cls, weight: torch.Tensor, kernel: Int8RowsKernel | None = None) -> Int8Weight:
        if not int8_fits(weight):
            raise ValueError(f"int8 needs a CPU [out, in] matrix with both sizes multiples of 8, got {tuple(weight.shape)}")
        values, scales = quantize_rows(weight.detach())
        return cls(values.contiguous(), scales.squeeze(1).contiguous(), kernel)

    @property
    def nbytes(self) -> int:
        return self.values.numel() + self.scales.numel() * 4

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scales.unsqueeze(1)

    def _products(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The int32 products of x's quantized rows, their scales, and whether the kernel
        takes x (then it dequantizes too)."""
        fast = self.kernel is not None and self.kernel.takes(x, self.values.shape[0])
        quantized, row_scales = self.kernel.quantize_rows(x) if fast else quantize_rows(x)
        return torch._int_mm(quantized, self.values.t()), row_scales, fast

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in] (any float dtype) -> x @ W.T (+ bias) (+ residual), [M, out] in x's dtype."""
        products, row_scales, fast = self._products(x)
        if fast:
            return self.kernel.dequantize(products, row_scales, self.scales, x.dtype, bias, residual)
        out = (products.float() * row_scales * self.scales).to(x.dtype)
        out = out if bias is None else out + bias
        return out if residual is None else residual + out
