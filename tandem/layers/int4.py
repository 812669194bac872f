"""4-bit weight-only matrices for small steps: a quarter of bf16's bytes per weight read.

A step of one or two tokens multiplies a few rows by every weight matrix once: the time goes
into reading the weights, so fewer bytes per weight is a faster step. Each group of
`group_size` consecutive input columns of an output row shares one scale and one zero point
(asymmetric round-to-nearest, `w ≈ (q − 8) · scale + zero`, q in 0..15), stored in the layout
of PyTorch's CPU int4 kernel (`torch._weight_int4pack_mm_for_cpu`, the kernel gpt-fast and
torchao use), which unpacks the nibbles in registers and never materialises a dense matrix.

Measured on the 2-core AVX-512 EPYC, one thread, the 24 layers of Qwen2.5-Coder-0.5B's
matrices streamed from memory: 20 ms per one-token step in int4 against 46 ms for
oneDNN-packed bf16 and 35 ms for fp16, 25 ms against 51 ms at two tokens; from about four
tokens on the unpacking costs more than the bytes it saves (57 vs 37 ms at five, 2.5x slower
at 64), so larger steps keep the dense weights.

The GGUF files tandem's aliases install are Q4_K_M: most of their matrices are already 4-bit
with a scale and a minimum per 32 columns, which this grid represents again almost exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZES = (32, 64, 128, 256)  # what the kernel accepts
_ROW_MULTIPLE = 16  # the packed layout interleaves 16 output rows


def int4_available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


def int4_fits(weight: torch.Tensor, group_size: int) -> bool:
    """Whether the kernel takes this [out, in] matrix with this group size."""
    return (weight.dim() == 2 and weight.shape[0] % _ROW_MULTIPLE == 0 and weight.shape[1] % group_size == 0
            and weight.device.type == "cpu")


@dataclass
class Int4Weight:
    """A [out, in] matrix as packed nibbles plus a (scale, zero) pair per row and group."""

    packed: torch.Tensor  # uint8 [out, in / 2], the kernel's layout
    scales_and_zeros: torch.Tensor  # [in / group_size, out, 2] in the activations' dtype
    group_size: int
    out_features: int

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int = 32, dtype: torch.dtype | None = None) -> Int4Weight:
        """Round `weight` to the 16-level grid of each group's own min..max range; the scales
        and zeros are kept in `dtype` (the activations' dtype; default the weight's)."""
        if group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}")
        if not int4_fits(weight, group_size):
            raise ValueError(f"int4 needs a CPU [out, in] matrix with out % {_ROW_MULTIPLE} == 0 and in % "
                             f"{group_size} == 0, got {tuple(weight.shape)}")
        out_features, in_features = weight.shape
        groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
        low = groups.amin(dim=-1, keepdim=True)
        high = groups.amax(dim=-1, keepdim=True)
        scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        q = ((groups - low) / scale).round_().clamp_(0, 15).to(torch.int32).reshape(out_features, in_features)
        zero = low + 8 * scale  # (q - 8) * scale + zero == q * scale + low
        scales_and_zeros = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1).contiguous()
        return cls(
            packed=torch._convert_weight_to_int4pack_for_cpu(q, 1),
            scales_and_zeros=scales_and_zeros.to(dtype or weight.dtype),
            group_size=group_size,
            out_features=out_features,
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for x of shape [..., in]."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype != self.scales_and_zeros.dtype:
            rows = rows.to(self.scales_and_zeros.dtype)
        out = torch._weight_int4pack_mm_for_cpu(rows.contiguous(), self.packed, self.group_size, self.scales_and_zeros)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The dense [out, in] matrix these nibbles stand for (for tests and checks)."""
        eye = torch.eye(self.packed.shape[1] * 2, dtype=self.scales_and_zeros.dtype)
        return self.matmul(eye).t().contiguous()

    @property
    def nbytes(self) -> int:
        return (self.packed.numel() * self.packed.element_size()
                + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size())
