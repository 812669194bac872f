"""Paged self-attention: store this step's K/V in the cache, then attend through a backend."""

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

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata,
    ) -> torch.Tensor:
        self.backend.write_kv(key, value, kv_cache, meta)
        return self.backend.attend(query, key, value, kv_cache, meta, self.scale)
