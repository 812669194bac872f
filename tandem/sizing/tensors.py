"""The weight tensors of a model, listed from its `ModelShape`, and their parameter counts.

Memory per rank depends on how each tensor is split, so the plan lists tensors rather than
summing a closed formula: every entry says its shape, which component it belongs to, how
tensor parallelism splits it (`Split`) and whether it is a matmul weight (the tensors FP8
checkpoints quantise). `sharding.py` turns the list into bytes per rank; this module only
knows the architectures.

Shapes follow the HF modeling code (`modeling_llama`, `modeling_qwen2/3`, `modeling_qwen3_moe`,
`modeling_mixtral`, `modeling_deepseek_v3`, `modeling_llama4`): an nn.Linear(in, out) weight is
`rows=out, cols=in`. Each tensor also carries its module's name in the HF text model
(`model.layers.3.self_attn.q_a_proj`, `model.layers.3.mlp.experts.{expert}.up_proj`,
`lm_head`), which a compressed-tensors checkpoint's rules are matched against (quant.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from tandem.sizing.shape import ModelShape


class Split(Enum):
    """How tensor parallelism divides a tensor (vLLM's layer classes in brackets)."""

    COLUMN = "column"  # output rows split (ColumnParallelLinear: q/k/v, gate/up, MLA q_b/kv_b)
    ROW = "row"  # input columns split (RowParallelLinear: o_proj, down_proj)
    KV_HEADS = "kv_heads"  # column split by KV head, replicated when tp > heads (QKVParallelLinear)
    VOCAB = "vocab"  # vocabulary rows split (VocabParallelEmbedding, ParallelLMHead)
    REPLICATED = "replicated"  # whole on every rank (norms, router, MLA q_a / kv_a)


class Part(Enum):
    """The component a tensor belongs to, for the parameter breakdown."""

    EMBEDDING = "embedding"
    ATTENTION = "attention"
    DENSE_MLP = "dense MLP"
    ROUTED_EXPERTS = "routed experts"
    SHARED_EXPERTS = "shared experts"
    ROUTER = "router"
    NORMS = "norms"
    LM_HEAD = "LM head"


@dataclass(frozen=True)
class Tensor:
    """One weight (or a stack of `experts` same-shaped weights, one per routed expert)."""

    name: str
    part: Part
    rows: int
    cols: int = 1
    split: Split = Split.REPLICATED
    linear: bool = False  # a matmul weight: stored as FP8 + block scales in FP8 checkpoints
    experts: int = 0  # > 0: a routed expert's weight, `experts` copies
    heads: int = 0  # Split.KV_HEADS: the number of heads in `rows`
    fp32: bool = False  # kept in float32 whatever the model dtype (DeepSeek's router bias)
    module: str = ""  # the HF module's name in the text model ("{expert}" for the expert index)

    @property
    def numel(self) -> int:
        return self.rows * self.cols * max(self.experts, 1)


def _linear(name: str, part: Part, out: int, inp: int, split: Split, experts: int = 0,
            heads: int = 0, module: str = "") -> Tensor:
    return Tensor(name, part, out, inp, split, linear=True, experts=experts, heads=heads, module=module)


def _mlp(prefix: str, part: Part, hidden: int, width: int, experts: int = 0,
         bias: bool = False, module: str = "") -> list[Tensor]:
    """A SwiGLU MLP: gate and up (column-parallel), down (row-parallel); `module` is its HF
    module's name (the projections are `module.gate_proj` etc.)."""
    tensors = [_linear(f"{prefix}.gate_proj", part, width, hidden, Split.COLUMN, experts, module=f"{module}.gate_proj"),
               _linear(f"{prefix}.up_proj", part, width, hidden, Split.COLUMN, experts, module=f"{module}.up_proj"),
               _linear(f"{prefix}.down_proj", part, hidden, width, Split.ROW, experts, module=f"{module}.down_proj")]
    if bias:
        tensors += [Tensor(f"{prefix}.gate_proj.bias", part, width, split=Split.COLUMN),
                    Tensor(f"{prefix}.up_proj.bias", part, width, split=Split.COLUMN),
                    Tensor(f"{prefix}.down_proj.bias", part, hidden)]
    return tensors


def attention_tensors(shape: ModelShape, layer: int = 0) -> list[Tensor]:
    """One layer's attention: GQA (q/k/v/o, biases, Qwen3's q/k norms) or DeepSeek's MLA."""
    h, a = shape.hidden_size, Part.ATTENTION
    attn = f"model.layers.{layer}.self_attn"

    def lin(name: str, out: int, inp: int, split: Split, heads: int = 0) -> Tensor:
        return _linear(name, a, out, inp, split, heads=heads, module=f"{attn}.{name}")

    if shape.mla is not None:
        m, heads = shape.mla, shape.num_heads
        qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q = [lin("q_a_proj", m.q_lora_rank, h, Split.REPLICATED),
                 Tensor("q_a_layernorm", a, m.q_lora_rank),
                 lin("q_b_proj", heads * qk_head, m.q_lora_rank, Split.COLUMN)]
        else:
            q = [lin("q_proj", heads * qk_head, h, Split.COLUMN)]
        return [*q,
                lin("kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, h, Split.REPLICATED),
                Tensor("kv_a_layernorm", a, m.kv_lora_rank),
                lin("kv_b_proj", heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, Split.COLUMN),
                lin("o_proj", h, heads * m.v_head_dim, Split.ROW)]
    q_width = shape.num_heads * shape.head_dim
    kv_width = shape.num_kv_heads * shape.head_dim
    kv = shape.num_kv_heads
    tensors = [lin("q_proj", q_width, h, Split.COLUMN),
               lin("k_proj", kv_width, h, Split.KV_HEADS, heads=kv),
               lin("v_proj", kv_width, h, Split.KV_HEADS, heads=kv),
               lin("o_proj", h, q_width, Split.ROW)]
    if shape.qkv_bias:
        tensors += [Tensor("q_proj.bias", a, q_width, split=Split.COLUMN),
                    Tensor("k_proj.bias", a, kv_width, split=Split.KV_HEADS, heads=kv),
                    Tensor("v_proj.bias", a, kv_width, split=Split.KV_HEADS, heads=kv)]
    if shape.o_bias:
        tensors.append(Tensor("o_proj.bias", a, h))
    if shape.qk_norm:
        tensors += [Tensor("q_norm", a, shape.head_dim), Tensor("k_norm", a, shape.head_dim)]
    return tensors


def layer_tensors(shape: ModelShape, layer: int) -> list[Tensor]:
    """Decoder layer `layer`: its two norms, attention, and a dense MLP or a MoE block."""
    h = shape.hidden_size
    tensors = [Tensor("input_layernorm", Part.NORMS, h), Tensor("post_attention_layernorm", Part.NORMS, h),
               *attention_tensors(shape, layer)]
    mlp = f"model.layers.{layer}.mlp"  # DeepSeek's and Qwen's names (quant.py matches them)
    moe = shape.moe
    if moe is None or layer not in moe.layers:
        return tensors + _mlp("mlp", Part.DENSE_MLP, h, shape.intermediate_size, bias=False, module=mlp)
    # the router (DeepSeek's MoEGate) is no nn.Linear: never quantized
    tensors.append(Tensor("router", Part.ROUTER, moe.num_experts, h, module=f"{mlp}.gate"))
    if moe.router_bias:
        tensors.append(Tensor("router.e_score_correction_bias", Part.ROUTER, moe.num_experts, fp32=True))
    tensors += _mlp("experts", Part.ROUTED_EXPERTS, h, moe.expert_intermediate, experts=moe.num_experts,
                    module=f"{mlp}.experts.{{expert}}")
    if moe.shared_intermediate:
        tensors += _mlp("shared_expert", Part.SHARED_EXPERTS, h, moe.shared_intermediate,
                        module=f"{mlp}.shared_experts")
    return tensors


def embedding_tensors(shape: ModelShape) -> list[Tensor]:
    return [Tensor("embed_tokens", Part.EMBEDDING, shape.vocab_size, shape.hidden_size, Split.VOCAB,
                   module="model.embed_tokens")]


def head_tensors(shape: ModelShape, separate_copy: bool = False) -> list[Tensor]:
    """The final norm and the LM head; a tied head is the embedding, unless `separate_copy`
    (a last pipeline stage that does not hold the embedding keeps its own copy)."""
    tensors = [Tensor("norm", Part.NORMS, shape.hidden_size)]
    if not shape.tie_word_embeddings or separate_copy:
        # not `linear`: FP8 checkpoints keep it in the model dtype (compressed-tensors ones
        # quantize it unless `ignore` names it, sharding.int_scheme)
        tensors.append(Tensor("lm_head", Part.LM_HEAD, shape.vocab_size, shape.hidden_size, Split.VOCAB,
                              module="lm_head"))
    return tensors


def model_tensors(shape: ModelShape) -> list[Tensor]:
    """Every tensor of the text model (one copy of a tied head)."""
    tensors = embedding_tensors(shape)
    for layer in range(shape.num_layers):
        tensors += layer_tensors(shape, layer)
    return tensors + head_tensors(shape)


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the text model by component; `active` counts top-k of the routed experts."""

    by_part: dict[str, int]
    total: int
    active: int
    vision: int  # the vision tower, not part of `total` (a text-only plan does not load it)


def count_params(shape: ModelShape) -> ParamCounts:
    """Total and per-token active parameters.

    Active = everything but the routed experts, plus top_k / num_experts of them (the input
    embedding included: conventions differ, and published "active" figures are rounded).
    """
    return _count(shape, model_tensors(shape))


def _count(shape: ModelShape, tensors: Iterable[Tensor]) -> ParamCounts:
    by_part = {part.value: 0 for part in Part}
    active = 0.0
    for t in tensors:
        by_part[t.part.value] += t.numel
        share = shape.moe.top_k / shape.moe.num_experts if t.experts and shape.moe else 1.0
        active += t.numel * share
    by_part = {k: v for k, v in by_part.items() if v}
    return ParamCounts(by_part=by_part, total=sum(by_part.values()), active=round(active),
                       vision=shape.vision.params if shape.vision else 0)
