"""Checkpoint fix-ups for multi-head latent attention weights.

DeepSeek-V3 and Kimi-K2 checkpoints rotate their rotary dimensions in interleaved pairs
(x0, x1), (x2, x3), ... (`rope_interleave`). Reordering the rows that produce those
dimensions (evens first, then odds) turns that into the rotate-half form every other model
here uses, exactly: attention only takes dot products of rotated queries and keys, and both
sides get the same order. Done once at load, so no step pays for a strided rotation.
"""

from __future__ import annotations

import torch

from tandem.config import MLAConfig


def _deinterleave(rows: torch.Tensor) -> torch.Tensor:
    return torch.cat((rows[0::2], rows[1::2]))


def deinterleave_rope_rows(name: str, tensor: torch.Tensor, mla: MLAConfig, num_heads: int) -> torch.Tensor:
    """`tensor` (checkpoint `name`) with its rotary output rows in rotate-half order."""
    if not mla.rope_interleave:
        return tensor
    rope = mla.qk_rope_head_dim
    if name.endswith(("q_b_proj.weight", "q_proj.weight")):
        per_head = tensor.reshape(num_heads, mla.qk_head_dim, *tensor.shape[1:])
        nope, rot = per_head.split([mla.qk_nope_head_dim, rope], dim=1)
        rot = torch.cat((rot[:, 0::2], rot[:, 1::2]), dim=1)
        return torch.cat((nope, rot), dim=1).reshape(tensor.shape)
    if name.endswith(("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias")):
        latent, rot = tensor.split([mla.kv_lora_rank, rope], dim=0)
        return torch.cat((latent, _deinterleave(rot)))
    return tensor
