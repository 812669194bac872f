"""Paged self-attention: store this step's K/V in the cache, then attend through a backend.

An fp8 cache (--kv-cache-dtype fp8) stores key / k_scale and value / v_scale, per layer
(worker/kv_scales.py measures them at start; 1.0 until then and for every other cache). The
kernels need not know: q . (k / k_scale) times the softmax scale times k_scale is q . k times
it, and the weighted sum of v / v_scale times v_scale is the output. The scales are powers of
two, so dividing by them is exact until the fp8 rounding. A backend whose write takes the
multipliers (`scaled_kv_write`, the Triton kernels) divides inside its write kernel instead.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.kernels.base import AttentionBackend, AttentionMetadata


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.k_scale = 1.0
        self.v_scale = 1.0
        # While the worker calibrates the scales: each forward's largest |key| and |value|.
        self.observed: list[tuple[float, float]] | None = None

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.observed is not None:
            self.observed.append((float(key.abs().amax()), float(value.abs().amax())))
        if self.k_scale == 1.0 and self.v_scale == 1.0:
            self.backend.write_kv(key, value, kv_cache, meta)
            return self.backend.attend(query, key, value, kv_cache, meta, self.scale)
        if self.backend.capabilities.scaled_kv_write:  # its attend reads the cache, not key / value
            self.backend.write_kv_scaled(key, value, kv_cache, meta, 1.0 / self.k_scale, 1.0 / self.v_scale)
        else:
            key, value = key / self.k_scale, value / self.v_scale
            self.backend.write_kv(key, value, kv_cache, meta)
        return self.backend.attend(query, key, value, kv_cache, meta, self.scale * self.k_scale) * self.v_scale
