"""Checkpoint fix-ups for multi-head latent attention weights.

DeepSeek-V3 and Kimi-K2 checkpoints rotate their rotary dimensions in interleaved pairs
(x0, x1), (x2, x3), ... (`rope_interleave`). Reordering the rows that produce those
dimensions (evens first, then odds) turns that into the rotate-half form every other model
here uses, exactly: attention only takes dot products of rotated queries and keys, and both
sides get the same order. Done once at load, so no step pays for a strided rotation.

The reorder is done in place on the loaded parameter (`deinterleave_rope_rows_`), after the
layer took its tensor-parallel slice: it moves rows within each head, and a rank holds whole
heads, so a rank reorders only the rows it keeps and never reads the other ranks' heads from
the checkpoint (a reorder of the checkpoint tensor before slicing would read all of it).
"""

from __future__ import annotations

import torch

from tandem.config import MLAConfig

_QUERY = ("q_b_proj.weight", "q_proj.weight")
_LATENT = ("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias")


def has_interleaved_rope_rows(name: str, mla: MLAConfig) -> bool:
    """Whether checkpoint tensor `name` holds rotary rows that need reordering."""
    return mla.rope_interleave and name.endswith(_QUERY + _LATENT)


def deinterleave_rope_rows_(name: str, rows: torch.Tensor, mla: MLAConfig) -> torch.Tensor:
    """Put the rotary rows of `rows` (checkpoint `name`'s weight or bias, or this rank's whole
    heads of it) in rotate-half order, in place; returns `rows`."""
    if not has_interleaved_rope_rows(name, mla):
        return rows
    if name.endswith(_QUERY):
        if rows.shape[0] % mla.qk_head_dim:
            raise ValueError(f"{name}: {rows.shape[0]} rows are not whole heads of {mla.qk_head_dim}")
        rot = rows.view(-1, mla.qk_head_dim, *rows.shape[1:])[:, mla.qk_nope_head_dim :]
        rot.copy_(torch.cat((rot[:, 0::2], rot[:, 1::2]), dim=1))
    else:
        rot = rows[mla.kv_lora_rank :]
        rot.copy_(torch.cat((rot[0::2], rot[1::2])))
    return rows


def deinterleave_rope_rows(name: str, tensor: torch.Tensor, mla: MLAConfig, num_heads: int) -> torch.Tensor:
    """`tensor` (checkpoint `name`, all `num_heads` heads) with its rotary output rows in
    rotate-half order, as a new tensor."""
    if not has_interleaved_rope_rows(name, mla):
        return tensor
    if name.endswith(_QUERY) and tensor.shape[0] != num_heads * mla.qk_head_dim:
        raise ValueError(f"{name}: {tensor.shape[0]} rows, expected {num_heads} heads of {mla.qk_head_dim}")
    return deinterleave_rope_rows_(name, tensor.clone(), mla)
