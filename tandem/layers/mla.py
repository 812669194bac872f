"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over the paged cache.

MLA compresses each token's keys and values into one `kv_lora_rank` latent (RMS-normed) plus
one rotary key of `qk_rope_head_dim` shared by all heads; that 576-wide entry (for DeepSeek-V3
and Kimi-K2) is all the cache keeps, one plane of one "head" (config.KVCacheSpec), so the block
pool, prefix caching, the PD handoff and the KV tiers move it like any other block.

Two ways to attend over the cached latents, chosen per row of the flat batch:

* **Decode: absorbed.** `kv_b_proj` maps a latent to each head's key (nope part) and value.
  Folding the key half into the query (q_nope @ W_UK, per head) turns attention into MQA
  over the latent entries themselves: scores = [q_nope W_UK, q_rot] . [latent, k_rot], the
  output is a weighted sum of latents, and W_UV brings it back to each head's value space.
  Nothing is decompressed: a decode step reads 576 values per cached token instead of
  heads x (192 + 128).
* **Prefill: decompressed.** A chunk has many queries per cached token, so expanding the
  context once (latent @ kv_b_proj -> per-head K and V) and running ordinary attention costs
  less than lifting every query into the 512-wide latent space. The context comes from the
  cache, so a chunk over a cached prefix (prefix hit, PD handoff, tier load) works the same.

Both compute the same function: `tests/layers/test_mla.py` checks them against each other
and against transformers' DeepseekV3Attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import MLAConfig, RopeConfig, yarn_mscale
from tandem.distributed.tensor_parallel import SINGLE_RANK, TensorParallel
from tandem.kernels.attention_registry import latent_decoder
from tandem.kernels.base import AttentionBackend, AttentionMetadata, PrefillSpan
from tandem.kernels.kv_format import is_fp8_cache, is_int8_cache, quantize_rows, to_fp8, widen
from tandem.layers.linear import (
    ColumnParallelLinear,
    Linear,
    RowParallelLinear,
    dense_einsum,
    dense_linear,
)
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding


class LatentUpProjection(nn.Module):
    """`kv_b_proj`: latent -> per-head (key nope part, value). A plain parameter rather than a
    packed Linear: the absorbed decode reads its two halves as per-head matrices."""

    def __init__(
        self, kv_lora_rank: int, num_heads: int, nope_dim: int, v_dim: int, tp: TensorParallel = SINGLE_RANK
    ) -> None:
        super().__init__()
        self.num_heads, self.nope_dim, self.v_dim = num_heads, nope_dim, v_dim  # this rank's heads
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(num_heads * (nope_dim + v_dim), kv_lora_rank), requires_grad=False)

    def load(self, param_name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        """The checkpoint's whole matrix; this rank keeps its heads' rows."""
        mine = self.tp.shard(tensor, 0)
        if mine.shape != self.weight.shape:
            raise ValueError(f"kv_b_proj: checkpoint {tuple(tensor.shape)} vs this rank's {tuple(self.weight.shape)}")
        self.weight.data.copy_(mine)

    def halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope, latent] and W_UV [heads, v, latent] (views of the weight)."""
        per_head = self.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        return per_head[:, : self.nope_dim], per_head[:, self.nope_dim :]

    def forward(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decompress [N, latent] into keys' nope part [N, heads, nope] and values [N, heads, v]."""
        kv = dense_linear(latent, self.weight).view(-1, self.num_heads, self.nope_dim + self.v_dim)
        return kv[..., : self.nope_dim], kv[..., self.nope_dim :]


def mla_softmax_scale(mla: MLAConfig, rope: RopeConfig) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale(all_dim) squared when the context is stretched."""
    scale = mla.qk_head_dim**-0.5
    if rope.rope_type == "yarn" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


class MultiLatentAttention(nn.Module):
    """Under tensor parallelism each rank computes its share of the heads (query and up
    projections split by head, o_proj by its input, one all-reduce); the latent is computed
    and cached whole on every rank, since every head reads all of it."""

    def __init__(
        self, mla: MLAConfig, hidden_size: int, num_heads: int, rms_norm_eps: float,
        rope: RopeConfig, rotary: RotaryEmbedding, backend: AttentionBackend, bias: bool = False,
        tp: TensorParallel = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.mla = mla
        self.num_heads = tp.divide(num_heads, "attention heads")
        self.rotary = rotary  # built over qk_rope_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, num_heads * mla.qk_head_dim, False, tp)
        else:
            self.q_a_proj = Linear(hidden_size, mla.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, num_heads * mla.qk_head_dim, False, tp)
        self.kv_a_proj_with_mqa = Linear(hidden_size, mla.latent_dim, bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, rms_norm_eps)
        self.kv_b_proj = LatentUpProjection(mla.kv_lora_rank, self.num_heads, mla.qk_nope_head_dim,
                                            mla.v_head_dim, tp)
        self.o_proj = RowParallelLinear(num_heads * mla.v_head_dim, hidden_size, bias, tp)
        self.scale = mla_softmax_scale(mla, rope)
        # Absorbed decode is MQA over the latent entries, keys and values both the cache's one
        # plane: the given backend's decode where it takes that, else the torch one.
        self._decode_attention = latent_decoder(backend)

    def forward(
        self, angles: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata, residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`residual` + attention output; `kv_cache` is one layer's [1, 1, blocks, block_size, latent_dim]."""
        mla, num_tokens = self.mla, hidden.shape[0]
        if mla.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_rot = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        q_rot = self.rotary(angles, q_rot)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        entry = torch.cat((self.kv_a_layernorm(latent), self.rotary(angles, k_rot.unsqueeze(1)).squeeze(1)), dim=-1)
        self._write(entry, kv_cache, meta)

        out = q.new_empty(num_tokens, self.num_heads, mla.v_head_dim)
        decodes = meta.num_decode_tokens
        if decodes:
            out[:decodes] = self._absorbed_decode(q_nope[:decodes], q_rot[:decodes], kv_cache, meta)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            out[rows] = self._decompressed_prefill(q_nope[rows], q_rot[rows], entry[rows], kv_cache, span)
        flat = out.view(num_tokens, self.num_heads * mla.v_head_dim)
        return self.o_proj(flat) if residual is None else self.o_proj(flat, residual)

    @staticmethod
    def _write(entry: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        if is_int8_cache(kv_cache):  # --kv-cache-dtype int8: the latent row and its scale
            entry = quantize_rows(entry)
        elif is_fp8_cache(kv_cache):  # --kv-cache-dtype fp8 (scale 1.0 for the latent rows), as bytes:
            entry, flat = to_fp8(entry).view(torch.uint8), flat.view(torch.uint8)  # no float8 index_copy_ on a CPU
        flat.index_copy_(0, meta.slot_mapping, entry.to(flat.dtype))

    def _absorbed_decode(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        w_uk, w_uv = self.kv_b_proj.halves()
        q_latent = dense_einsum("thn,hnl->thl", q_nope, w_uk)
        query = torch.cat((q_latent, q_rot), dim=-1)  # [T, heads, latent_dim]
        # Keys and values are the same latent entries: one stored plane, read as both.
        both = kv_cache.expand(2, -1, -1, -1, -1)
        attended = self._decode_attention.decode(query, both, meta, self.scale)
        return dense_einsum("thl,hvl->thv", attended[..., : self.mla.kv_lora_rank], w_uv)

    def _decompressed_prefill(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, fresh: torch.Tensor, kv_cache: torch.Tensor,
        span: PrefillSpan,
    ) -> torch.Tensor:
        mla = self.mla
        cached = span.context_len - span.q_len
        if cached > 0:
            rows = kv_cache[0, 0][span.block_ids].reshape(-1, kv_cache.shape[-1])[: span.context_len]
            context = widen(rows, q_nope.dtype)
        elif is_int8_cache(kv_cache):  # what the cache holds, as a prefix-cache hit will read it
            context = widen(quantize_rows(fresh), fresh.dtype)
        elif is_fp8_cache(kv_cache):
            context = widen(to_fp8(fresh), fresh.dtype)
        else:
            context = fresh
        latent, k_rot = context.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        k_nope, values = self.kv_b_proj(latent)
        keys = torch.cat((k_nope, k_rot.unsqueeze(1).expand(-1, self.num_heads, -1)), dim=-1)
        query = torch.cat((q_nope, q_rot), dim=-1)
        if cached > 0:
            mask = torch.arange(span.context_len).unsqueeze(0) <= torch.arange(cached, span.context_len).unsqueeze(1)
        else:
            mask = None
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, is_causal=mask is None, scale=self.scale,
        )
        return out.transpose(0, 1)
