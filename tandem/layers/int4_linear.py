"""A linear layer's weights kept in 4 bits, as a W4A16 checkpoint stores them.

A `compressed-tensors` pack-quantized checkpoint may quantize any `Linear`, not only routed
experts (llm-compressor's W4A16 recipes quantize every projection of the decoder and ignore
the LM head). Such a matrix W [out, in] arrives as `weight_packed` int32 [out, in / 8],
`weight_scale` bf16 [out, in / 32] and `weight_shape`, the same encoding as the INT4 experts
(layers/int4_experts.py, whose helpers convert it): levels 0..15 standing for -8..7, one scale
per 32 inputs, no zero point. `Int4Linear` holds this rank's share of it (its rows under a
column-parallel split, its columns under a row-parallel one, each projection of a merged
q/k/v or gate/up at its own row offset) without a dense temporary, and computes x @ W.T: on
the CPU with tandem's 4-bit GEMM (kernels/q4_gemm.py, bf16 scales, symmetric levels) for
steps of any size; on a GPU in the checkpoint's int32 words through the Triton W4A16 grouped
GEMM with one group (kernels/gpu/int4_moe.py); else by dequantizing for torch (correct, not
fast). The scales are kept bit for bit in an int16 buffer, so a loaded layer is exactly the
checkpoint's matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.q4_gemm import BLOCK, GROUP, Q4Kernel
from tandem.layers.int4_experts import (
    PACK,
    dequantize_nibbles,
    dequantize_words,
    kernel_nibbles,
    unpack_int32_levels,
)

INT4_FIELDS = ("weight_packed", "weight_scale", "weight_shape")

Part = tuple[int, int]  # (start, length)


class Int4Linear(nn.Module):
    """[out, in] 4-bit levels and bf16 group scales: the kernel's nibbles on the CPU, the
    checkpoint's int32 words on a GPU."""

    def __init__(self, out_features: int, in_features: int, device: torch.device) -> None:
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"INT4 weights need an input width divisible by {BLOCK} (the 4-bit kernel's "
                             f"block), got {in_features} on this rank")
        self.out_features, self.in_features = out_features, in_features
        self.words = device.type != "cpu"
        per_row = in_features // PACK if self.words else in_features // 2
        dtype = torch.int32 if self.words else torch.uint8
        self.register_buffer("packed", torch.empty(out_features, per_row, dtype=dtype, device=device))
        self.register_buffer("scales", torch.empty(out_features, in_features // GROUP, dtype=torch.int16,
                                                   device=device))
        self.kernel: Q4Kernel | None = None

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales.numel() * 2

    def load(self, field: str, tensor: torch.Tensor, whole: tuple[int, int], rows: Part | None = None,
             columns: Part | None = None, offset: int = 0) -> None:
        """One checkpoint tensor of an [out, in] = `whole` matrix: this layer keeps `rows` of it
        (all where None) at row `offset`, and `columns` of its inputs (all where None)."""
        if field == "weight_shape":
            if [int(v) for v in tensor.flatten().tolist()] != list(whole):
                raise ValueError(f"weight_shape is {tensor.tolist()}, expected {list(whole)}")
            return
        per_input = PACK if field == "weight_packed" else GROUP
        expected = (whole[0], whole[1] // per_input)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{field}: checkpoint {tuple(tensor.shape)}, expected {expected}")
        if rows is not None:
            tensor = tensor.narrow(0, *rows)
        if columns is not None:
            start, length = columns
            if start % BLOCK or length % BLOCK:
                raise ValueError(f"a row-parallel INT4 split must fall on {BLOCK}-input blocks, got columns "
                                 f"{start}..{start + length}")
            tensor = tensor.narrow(1, start // per_input, length // per_input)
        if field == "weight_packed":
            if tensor.dtype != torch.int32:
                raise ValueError(f"weight_packed is {tensor.dtype}; INT4 levels come in int32 words")
            target = self.packed.narrow(0, offset, tensor.shape[0])
            target.copy_(tensor if self.words else kernel_nibbles(unpack_int32_levels(tensor)))
        elif field == "weight_scale":
            if tensor.dtype != torch.bfloat16:
                raise ValueError(f"weight_scale is {tensor.dtype}; INT4 weights take bf16 scales")
            self.scales.narrow(0, offset, tensor.shape[0]).view(torch.bfloat16).copy_(tensor)
        else:
            raise ValueError(f"not an INT4 weight tensor: {field}")

    def dequantize(self) -> torch.Tensor:
        """The matrix in fp32."""
        if self.words:
            return dequantize_words(self.packed, self.scales)
        return dequantize_nibbles(self.packed, self.scales)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> x @ W.T [..., out] in x's dtype."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if self.words and rows.is_cuda:
            from tandem.kernels.gpu.int4_moe import int4_moe_gemm

            offsets = torch.tensor([0, rows.shape[0]], dtype=torch.int32, device=rows.device)
            out = int4_moe_gemm(rows.contiguous(), offsets, self.packed.unsqueeze(0),
                                self.scales.view(torch.bfloat16).unsqueeze(0), max_rows=rows.shape[0])
        elif self.kernel is not None and rows.device.type == "cpu":
            out = self.kernel.gemm_scaled(self.packed, self.scales.view(torch.bfloat16), None,
                                          rows.float().contiguous()).to(x.dtype)
        else:
            out = F.linear(rows, self.dequantize().to(x.dtype))
        return out.reshape(*shape[:-1], self.out_features)


def attach_int4_linear_kernel(model: nn.Module, kernel: Q4Kernel | None) -> int:
    """Give every CPU INT4 linear the 4-bit GEMM (None: torch on dequantized weights); returns
    how many there are."""
    layers = [m for m in model.modules() if isinstance(m, Int4Linear) and not m.words]
    for layer in layers:
        layer.kernel = kernel
    return len(layers)
