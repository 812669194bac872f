"""Rotary position embedding with the scalings transformers supports for our families.

cos/sin are tabulated once for every position up to the context length, in fp32, with the
same inverse-frequency formulas as transformers so positions encode bit-identically.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import nn

from tandem.config import RopeConfig, yarn_mscale


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if rope.rope_type == "yarn":
        return _yarn_inverse_frequencies(rope, head_dim)
    return inv_freq


def _yarn_inverse_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: dimensions that turn many times over the original context keep their frequency
    (extrapolate), slow ones are divided by `factor` (interpolate), a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def rotary_magnitude(rope: RopeConfig) -> float:
    """What cos/sin are multiplied by: YaRN's attention factor, 1 for the other types."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


class RotaryPass(Protocol):
    """The rotation in one call, in place: the C pass on the CPU (attach_layer_ops), the
    Triton kernel on a GPU (attach_gpu_passes)."""

    def takes_rotary(self, x: torch.Tensor, cos: torch.Tensor) -> bool: ...

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...


class RotaryEmbedding(nn.Module):
    ops: RotaryPass | None = None  # one pass (C or Triton), else torch ops

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(rope, head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        magnitude = rotary_magnitude(rope)
        self.register_buffer("cos", (angles.cos() * magnitude).to(dtype), persistent=False)
        self.register_buffer("sin", (angles.sin() * magnitude).to(dtype), persistent=False)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for a step's positions, looked up once and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def forward(angles: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Rotate [T, heads, head_dim] queries and/or keys (rotate-half form)."""
        cos, sin = angles
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def rotate_(self, angles: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """`forward`, in place where the pass takes x (a fresh projection's output the caller
        owns): one call instead of seven ops. Returns the rotated tensor."""
        cos, sin = angles
        if self.ops is not None and self.ops.takes_rotary(x, cos):
            return self.ops.rotary_(x, cos, sin)
        return self(angles, x)
