"""Routed experts kept in 4 bits, as INT4 checkpoints ship them (Kimi K2.5's experts).

Kimi K2.5 stores every routed expert matrix W [out, in] in `compressed-tensors`'
pack-quantized INT4: `weight_packed` int32 [out, in / 8] (input 8w + j of a row in bits
4j..4j+3 of its word w, as the level q + 8 of a signed q in -8..7), `weight_scale` bf16
[out, in / 32] (one scale per group of 32 inputs, symmetric: no zero point), and
`weight_shape` [2]. The experts are 96% of the model's bytes: they are loaded as they are,
never widened to bf16 (a 2048 x 7168 matrix is 7.3 MB packed, 29 MB in bf16), and the
levels only reordered into the layout of tandem's 4-bit kernel (kernels/q4_gemm.py: per 64
inputs, input j in byte j's low nibble and input j + 32 in its high one). The bf16 scales are
kept bit for bit (the kernel reads bf16 or fp16 scales), so a loaded expert is exactly the
checkpoint's matrix.

`Int4Experts` holds one layer's experts (this rank's share: its slice of every expert's
intermediate size under tensor parallelism, its whole experts under expert parallelism) and
runs them: on the CPU in one C call over all experts that received rows (`tandem_q4_moe`:
gate/up GEMM, SiLU * up, down GEMM); on a GPU in the checkpoint's own int32 words
(`use_packed_words`, called as the model is placed on the device: the tensors are made there
in that layout, nothing is reordered) by the Triton W4A16 grouped GEMM
(kernels/gpu/int4_moe.py: gate/up with SiLU * up fused, then down); without a C compiler, by
dequantizing one expert at a time for torch (correct, not fast).

The scales live in int16 buffers holding the bf16 bits, so the model-wide `.to(dtype)` of
the loader leaves them alone; `scales()` gives them back as bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed.tensor_parallel import SINGLE_RANK, TensorParallel
from tandem.kernels.q4_gemm import BLOCK, GROUP, Q4ExpertStack, Q4Kernel

PACK = 8  # 4-bit levels per int32 word of a compressed-tensors checkpoint
PROJECTIONS = ("gate", "up", "down")
FIELDS = ("weight_packed", "weight_scale", "weight_shape")


def unpack_int32_levels(packed: torch.Tensor) -> torch.Tensor:
    """[rows, words] int32 -> [rows, 8 * words] uint8 levels 0..15 (input 8w + j from bits
    4j..4j+3 of word w)."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"packed INT4 weights are a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8).reshape(packed.shape[0], -1)


def pack_int32_levels(levels: torch.Tensor) -> torch.Tensor:
    """The inverse: [rows, in] levels 0..15 -> [rows, in / 8] int32 words."""
    rows, inputs = levels.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=levels.device)
    words = (levels.reshape(rows, inputs // PACK, PACK).to(torch.int64) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def kernel_nibbles(levels: torch.Tensor) -> torch.Tensor:
    """[rows, in] levels -> the 4-bit kernel's [rows, in / 2] bytes: per block of 64 inputs,
    input j in byte j's low nibble and input j + 32 in its high nibble."""
    rows, inputs = levels.shape
    if inputs % BLOCK:
        raise ValueError(f"the 4-bit kernel takes rows of a multiple of {BLOCK} inputs, got {inputs}")
    pairs = levels.reshape(rows, inputs // BLOCK, 2, GROUP)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(rows, inputs // 2)


def kernel_levels(nibbles: torch.Tensor) -> torch.Tensor:
    """The inverse of `kernel_nibbles`: [rows, in / 2] bytes -> [rows, in] levels."""
    rows = nibbles.shape[0]
    blocks = nibbles.reshape(rows, -1, GROUP)
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=2).reshape(rows, -1)


class Int4Experts(nn.Module):
    """A layer's routed experts (`num_experts` local ones), 4-bit symmetric with bf16 group
    scales; `intermediate` is this rank's share of one expert's intermediate size."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate: int, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__()
        for what, size in (("hidden size", hidden_size), ("intermediate size (this rank's share)", intermediate)):
            if size % BLOCK:
                raise ValueError(f"INT4 experts need a {what} divisible by {BLOCK} (the 4-bit kernel's block), "
                                 f"got {size}")
        self.tp = tp
        self.hidden_size = hidden_size
        self.intermediate = intermediate
        wide = 2 * intermediate
        self.register_buffer("w13", torch.empty(num_experts, wide, hidden_size // 2, dtype=torch.uint8))
        self.register_buffer("s13", torch.empty(num_experts, wide, hidden_size // GROUP, dtype=torch.int16))
        self.register_buffer("w2", torch.empty(num_experts, hidden_size, intermediate // 2, dtype=torch.uint8))
        self.register_buffer("s2", torch.empty(num_experts, hidden_size, intermediate // GROUP, dtype=torch.int16))
        self.kernel: Q4Kernel | None = None  # attached after loading, on the CPU (attach_int4_expert_kernel)
        self.packed_words = False  # the checkpoint's int32 words instead of the C kernel's nibbles

    def use_packed_words(self, device: torch.device) -> None:
        """Hold the levels as the checkpoint's int32 words [E, N, K / 8], on `device`, for the
        Triton kernel: called before loading, in place of the (never touched) nibble buffers."""
        experts, wide, hidden, inter = self.num_experts, 2 * self.intermediate, self.hidden_size, self.intermediate
        self.w13 = torch.empty(experts, wide, hidden // PACK, dtype=torch.int32, device=device)
        self.w2 = torch.empty(experts, hidden, inter // PACK, dtype=torch.int32, device=device)
        self.s13 = torch.empty(experts, wide, hidden // GROUP, dtype=torch.int16, device=device)
        self.s2 = torch.empty(experts, hidden, inter // GROUP, dtype=torch.int16, device=device)
        self.packed_words = True

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def stack(self) -> Q4ExpertStack:
        return Q4ExpertStack(self.w13, self.s13.view(torch.bfloat16), self.w2, self.s2.view(torch.bfloat16))

    # --- loading ------------------------------------------------------------------------------
    def load(self, expert: int, projection: str, field: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor of local expert `expert`: `field` of its `projection` (gate,
        up, down) matrix, the whole model's [out, in] (packed [out, in / 8], scales [out, in /
        32]); this rank keeps its tensor-parallel slice."""
        if projection not in PROJECTIONS or field not in FIELDS:
            raise ValueError(f"not an INT4 expert tensor: {projection}.{field}")
        inter, hidden = self.intermediate * self.tp.size, self.hidden_size
        whole = (hidden, inter) if projection == "down" else (inter, hidden)
        if field == "weight_shape":
            if [int(v) for v in tensor.flatten().tolist()] != list(whole):
                raise ValueError(f"{projection}_proj.weight_shape is {tensor.tolist()}, expected {list(whole)}")
            return
        per_row = whole[1] // PACK if field == "weight_packed" else whole[1] // GROUP
        if tuple(tensor.shape) != (whole[0], per_row):
            raise ValueError(f"{projection}_proj.{field}: checkpoint {tuple(tensor.shape)}, expected "
                             f"{(whole[0], per_row)}")
        # gate/up: this rank's rows of the intermediate; down: its columns of it
        part = self.tp.shard(tensor, 1 if projection == "down" else 0)
        if field == "weight_packed":
            target = self.w2[expert] if projection == "down" else self._w13_rows(self.w13[expert], projection)
            target.copy_(part if self.packed_words else kernel_nibbles(unpack_int32_levels(part)))
        else:
            if tensor.dtype != torch.bfloat16:
                raise ValueError(f"{projection}_proj.weight_scale is {tensor.dtype}; INT4 experts take bf16 scales")
            target = self.s2[expert] if projection == "down" else self._w13_rows(self.s13[expert], projection)
            target.view(torch.bfloat16).copy_(part)

    def _w13_rows(self, stacked: torch.Tensor, projection: str) -> torch.Tensor:
        return stacked.narrow(0, 0 if projection == "gate" else self.intermediate, self.intermediate)

    def init_dummy_(self, generator: torch.Generator) -> None:
        """Random levels and scales of a normal(0, 0.02) matrix's size, for --load-format dummy."""
        for nibbles, scales in ((self.w13, self.s13), (self.w2, self.s2)):
            levels = nibbles.view(torch.uint8)  # int32 words too: any bytes are valid levels
            levels.copy_(torch.randint(0, 256, levels.shape, generator=generator, dtype=torch.uint8,
                                       device=nibbles.device))
            # levels -8..7 times 0.02 * 3 / 8: a spread like the dense dummy weights'
            value = torch.full(scales.shape, 0.0075, dtype=torch.bfloat16, device=scales.device)
            scales.view(torch.bfloat16).copy_(value)

    # --- running ------------------------------------------------------------------------------
    def dequantized(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert `expert`'s (gate/up [2I, H], down [H, I]) as fp32 matrices."""
        if self.packed_words:
            return (dequantize_words(self.w13[expert], self.s13[expert]),
                    dequantize_words(self.w2[expert], self.s2[expert]))
        return (dequantize_nibbles(self.w13[expert], self.s13[expert]), dequantize_nibbles(self.w2[expert], self.s2[expert]))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each local expert's SwiGLU on its slice of `rows` (sorted by expert, counts[e] rows
        for local expert e)."""
        if self.packed_words:
            return self._triton_forward(rows, counts)
        if self.kernel is not None and rows.device.type == "cpu":
            offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
            offsets[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
            out = self.kernel.moe(self.stack(), rows.float().contiguous(), offsets)
            return out.to(rows.dtype)
        outputs = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            w13, w2 = (w.to(rows.dtype) for w in self.dequantized(expert))
            part = rows[start : start + count]
            gate, up = F.linear(part, w13).split(self.intermediate, dim=-1)
            outputs[start : start + count] = F.linear(F.silu(gate) * up, w2)
            start += count
        return outputs


    def _triton_forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        from tandem.kernels.gpu.int4_moe import int4_moe_gemm

        offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
        offsets[1:] = torch.tensor(counts, dtype=torch.int32).cumsum(0)
        offsets = offsets.to(rows.device)
        most = max(counts, default=0)
        x = rows.contiguous()
        hidden = int4_moe_gemm(x, offsets, self.w13, self.s13.view(torch.bfloat16), silu_mul=True, max_rows=most)
        return int4_moe_gemm(hidden, offsets, self.w2, self.s2.view(torch.bfloat16), max_rows=most)


def dequantize_words(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    levels = unpack_int32_levels(words).float() - 8
    return levels * scales.view(torch.bfloat16).float().repeat_interleave(GROUP, dim=-1)


def dequantize_nibbles(nibbles: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    levels = kernel_levels(nibbles).float() - 8
    scale = scales.view(torch.bfloat16).float().repeat_interleave(GROUP, dim=-1)
    return levels * scale


def attach_int4_expert_kernel(model: nn.Module, kernel: Q4Kernel | None) -> int:
    """Give every INT4 expert layer the C kernel (None: they keep torch's per-expert path);
    returns the layers found, after checking each stack's layout once."""
    layers = [module for module in model.modules() if isinstance(module, Int4Experts) and not module.packed_words]
    for layer in layers:
        layer.stack().check()
        layer.kernel = kernel
    return len(layers)
