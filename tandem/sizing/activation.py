"""Peak activation and workspace memory of one forward pass on one rank (an estimate).

A step runs at most T = max_num_batched_tokens tokens through the model and samples at most
S = min(max_num_seqs, T) rows. Layers run one after another, so the peak is the residual
stream plus the largest intermediate any one layer (or the sampler) holds at a time:

    peak = hidden + max(attention, mlp, logits)

with a = activation bytes (the model dtype; bfloat16 for FP8 checkpoints) and per-rank
widths (heads, MLP width) after tensor parallelism:

- hidden    = 2 T h a: the residual stream and the normed input of the current layer.
- attention = GQA: T (q + 2 kv) d a for the fused QKV output + T q d a for the attention
              output, q and kv heads per rank, d the head dim.
              MLA (prefill computes the full keys and values from the latent):
              T a (q_lora + n (nope + rope) + kv_lora + rope + n (nope + v) + n (nope + rope) + n v),
              n heads per rank: the q latent, q, the kv latent, the up-projected k_nope|v,
              k with its rope part, the output.
- mlp       = dense: T a (3 I + h), gate|up output, the activated product, the down output.
              MoE: T k a (h + 3 I_e + h) for the k routed copies of each token (the permuted
              input, gate|up, product, down output; dispatch buffers are sized for the worst
              case, all T k rows on one rank, with or without EP) + T E 4 for the float32
              router logits + T a 3 I_s for the shared expert; I_e is the expert width per
              rank (I_e / tp under TP, whole under EP).
- logits    = 2 S V 4: float32 logits over the whole vocabulary for the sampled rows (after
              the all-gather of the vocab-parallel head) and one working copy for
              softmax / top-k / top-p. Last pipeline stage only.

Not counted: CUDA graphs' private pools, fragmentation, and the attention kernels' own
scratch (FlashAttention's is O(T x heads) floats, noise beside the above).
"""

from __future__ import annotations

from tandem.sizing.shape import DTYPE_BYTES, ModelShape
from tandem.sizing.sharding import Parallel


def activation_peak_bytes(shape: ModelShape, parallel: Parallel, layers: range, last: bool,
                          dtype: str, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The estimate above for one rank of the stage running `layers` (`last`: holds the head)."""
    t, a, h, tp = max_num_batched_tokens, DTYPE_BYTES[dtype], shape.hidden_size, parallel.tp
    hidden = 2 * t * h * a
    heads = shape.num_heads // tp
    if shape.mla is not None:
        m = shape.mla
        nope, rope = m.qk_nope_head_dim, m.qk_rope_head_dim
        attention = t * a * ((m.q_lora_rank or 0) + heads * (nope + rope) + m.kv_lora_rank + rope
                             + heads * (nope + m.v_head_dim) + heads * (nope + rope)
                             + heads * m.v_head_dim)
    else:
        kv_heads = max(shape.num_kv_heads // tp, 1)
        attention = t * a * shape.head_dim * ((heads + 2 * kv_heads) + heads)
    mlp = 0
    moe = shape.moe
    if any(moe is None or layer not in moe.layers for layer in layers):
        mlp = t * a * (3 * shape.intermediate_size // tp + h)
    if moe is not None and any(layer in moe.layers for layer in layers):
        width = moe.expert_intermediate if parallel.ep else moe.expert_intermediate // tp
        routed = t * moe.top_k * a * (2 * h + 3 * width)
        mlp = max(mlp, routed + t * moe.num_experts * 4 + t * a * 3 * moe.shared_intermediate // tp)
    logits = 2 * min(max_num_seqs, t) * shape.vocab_size * 4 if last else 0
    return hidden + max(attention, mlp, logits)
