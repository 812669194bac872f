"""The attention backend interface and the per-step metadata every backend reads.

The model runner flattens a mixed batch into one token stream with the decode tokens first
(one per sequence) followed by the prefill chunks; a backend writes this step's K/V into the
paged cache through `slot_mapping` and attends each query to its sequence's cached context.
A GPU backend (Triton) implements the same two methods over the same metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk: queries [q_start, q_start + q_len) of the flat batch."""

    q_start: int
    q_len: int
    context_len: int  # cached tokens before this chunk + q_len
    block_ids: torch.Tensor  # int64 [ceil(context_len / block_size)]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # int64 [num_decodes, max_blocks] (padded with 0)
    decode_context_lens: torch.Tensor  # int64 [num_decodes]
    decode_max_context_len: int
    prefills: list[PrefillSpan]
    block_size: int
    # Per-step scratch a backend fills once and reuses in every layer (the Triton backend's
    # chunk tensors, say); the runner makes new metadata each step.
    scratch: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AttentionCapabilities:
    """What a backend can do beyond `write_kv` and `attend`, so callers ask the backend
    rather than test its name."""

    # Padded decode rows are harmless (a negative slot is not written, a context of 0 reads
    # nothing) and its launches are sized from the metadata alone: decode steps can be graphs.
    pads_decode_rows: bool = False
    # The model runs on a GPU with Triton: norms, rotary and silu-and-mul may take its kernels.
    gpu_layer_passes: bool = False
    # `decode` takes MLA's absorbed decode: MQA over one latent plane read as keys and values,
    # with a head size that is not a power of two (tandem/layers/mla.py).
    latent_decode: bool = False
    # `write_kv_scaled` multiplies the step's keys and values by an fp8 cache's multipliers
    # (one over the layer's scales) inside the write, and `attend` reads every key and value
    # from the cache, never from its key / value arguments: the layer need not divide them first.
    scaled_kv_write: bool = False


class AttentionBackend(Protocol):
    name: str
    capabilities: AttentionCapabilities

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Store this step's keys/values ([T, kv_heads, head_dim]) into the paged cache."""

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """Causal attention of query [T, heads, head_dim] over each sequence's context."""

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """The decode rows alone ([num_decodes, heads, head_dim], one query per sequence) over
        the context already in the cache."""


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, num_planes: int = 2
) -> tuple[int, ...]:
    """One layer's cache: keys and values stacked, [2, kv_heads, num_blocks, block_size, head_dim]
    (a latent cache has one plane and one head: [1, 1, num_blocks, block_size, latent_dim]).

    Heads outermost: gathering a batch's blocks per head yields [kv_heads, seqs, tokens,
    head_dim] already contiguous, which a batched matmul reads without another copy.
    """
    return (num_planes, num_kv_heads, num_blocks, block_size, head_dim)
