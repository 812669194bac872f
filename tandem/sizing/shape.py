"""An HF `config.json` read into the few numbers a memory plan needs (`ModelShape`).

The plan never loads weights, so everything it knows about a model comes from here: the
dimensions, which layers are MoE, whether attention is GQA or MLA, and the dtype the
checkpoint ships in (including DeepSeek-style FP8 block quantisation). Each supported
architecture family has one reader; anything else is refused with the list of what is
supported, because guessing shapes for an unknown architecture would print a confident,
wrong plan.

The decoder's dimensions are read by `read_decoder_dims` and which layers route to experts
by `experts.expert_layout`; the engine's `ModelConfig` and `MoeConfig` are built from the same
two functions, so the plan and the engine cannot drift apart on what a config.json says
(transformers v5's `num_local_experts` for Qwen3-MoE included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.sizing.errors import PlanError
from tandem.sizing.experts import expert_layout

# The architectures the plan reads, by family. Kimi-K2 ships as DeepseekV3ForCausalLM.
DENSE_GQA = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED = (*DENSE_GQA, "Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM",
             "Llama4ForConditionalGeneration")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class MLAShape:
    """DeepSeek's multi-head latent attention: low-rank Q and a cached KV latent."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state (V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class DecoderDims:
    """A text decoder's dimensions as config.json states them: what the engine builds its
    layers from and what the plan counts bytes over."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # per attention head (MLA's query/key heads are described by `mla`)
    intermediate_size: int  # the dense MLP's width; 0 when config.json gives none
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool  # per-head RMSNorm weights on q and k (Qwen3)
    max_position_embeddings: int
    mla: MLAShape | None  # DeepSeek-V3 / Kimi-K2 with a kv_lora_rank


def read_decoder_dims(arch: str, text: dict[str, Any], top: dict[str, Any] | None = None) -> DecoderDims:
    """The decoder's dimensions from the dict `text` that holds them (`top` is the outer config
    of a wrapper such as Llama 4's, where tie_word_embeddings may live). KeyError names a
    required field that is missing."""
    top = text if top is None else top
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    is_qwen2 = arch == "Qwen2ForCausalLM"
    # Qwen2 always has q/k/v biases and never an o_proj bias; Llama-style models put
    # `attention_bias` on all four projections.
    bias = bool(text.get("attention_bias", False))
    mla = None
    if arch == "DeepseekV3ForCausalLM" and text.get("kv_lora_rank"):
        q_lora = text.get("q_lora_rank")
        mla = MLAShape(q_lora_rank=int(q_lora) if q_lora else None,
                       kv_lora_rank=int(text["kv_lora_rank"]),
                       qk_nope_head_dim=int(text["qk_nope_head_dim"]),
                       qk_rope_head_dim=int(text["qk_rope_head_dim"]),
                       v_head_dim=int(text["v_head_dim"]))
    return DecoderDims(
        vocab_size=int(text["vocab_size"]), hidden_size=hidden,
        num_layers=int(text["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        intermediate_size=int(text.get("intermediate_size") or 0),
        tie_word_embeddings=bool(top.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        qkv_bias=is_qwen2 or bias, o_bias=bias and not is_qwen2,
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        max_position_embeddings=int(text.get("max_position_embeddings") or 4096),
        mla=mla,
    )


@dataclass(frozen=True)
class MoEShape:
    """Routed experts (and an always-on shared expert) on the layers in `layers`."""

    num_experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int  # 0: no shared expert; else the shared MLP's width
    layers: frozenset[int]  # indices of the MoE layers; the rest have a dense MLP
    router_bias: bool  # DeepSeek's e_score_correction_bias (float32, one per expert)


@dataclass(frozen=True)
class VisionShape:
    """Llama 4's vision tower + projector, counted apart: a text-only plan does not load it."""

    params: int


@dataclass(frozen=True)
class ModelShape:
    """The model as the plan sees it: text decoder dimensions and what the checkpoint holds."""

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP's width (dense layers only, for MoE models)
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool  # per-head RMSNorm weights on q and k (Qwen3); Llama 4's L2 norm has none
    dtype: str  # the checkpoint's compute dtype: float32 | bfloat16 | float16
    fp8_block: tuple[int, int] | None  # FP8 e4m3 weights with one fp32 scale per block
    max_position_embeddings: int
    mla: MLAShape | None = None
    moe: MoEShape | None = None
    vision: VisionShape | None = None
    mtp_layers: int = 0  # DeepSeek's multi-token-prediction layers: in the checkpoint, not loaded

    @property
    def dense_layers(self) -> int:
        return self.num_layers - (len(self.moe.layers) if self.moe else 0)


def read_shape(config: dict[str, Any], name: str = "") -> ModelShape:
    """The `ModelShape` of an HF config dict; `PlanError` for an unsupported architecture."""
    architectures = config.get("architectures") or []
    arch = architectures[0] if architectures else ""
    if arch not in SUPPORTED:
        raise PlanError(f"architecture {arch or '(none in config.json)'!r} is not supported by the "
                        f"memory plan; supported: {', '.join(SUPPORTED)}")
    try:
        if arch == "Llama4ForConditionalGeneration":
            return _llama4(config, name)
        return _decoder(config, config, arch, name)
    except KeyError as exc:
        raise PlanError(f"config.json of {arch} has no {exc.args[0]!r}") from None


def _dtype(*sources: dict[str, Any]) -> str:
    for source in sources:
        value = source.get("torch_dtype") or source.get("dtype")
        if value:
            value = str(value).removeprefix("torch.")
            if value not in DTYPE_BYTES or value == "fp8":
                raise PlanError(f"config dtype {value!r} is not one of float32, bfloat16, float16")
            return value
    return "bfloat16"


def _fp8_block(config: dict[str, Any]) -> tuple[int, int] | None:
    quant = config.get("quantization_config") or {}
    if not quant:
        return None
    if quant.get("quant_method") != "fp8" or not quant.get("weight_block_size"):
        raise PlanError(f"quantization {quant.get('quant_method')!r} is not supported by the memory "
                        "plan (only FP8 with weight_block_size, as DeepSeek-V3 ships); pass --dtype "
                        "to plan the model unquantised")
    rows, cols = quant["weight_block_size"]
    return int(rows), int(cols)


def _decoder(text: dict[str, Any], top: dict[str, Any], arch: str, name: str) -> ModelShape:
    """Every family but Llama 4's wrapper: the dict `text` holds the decoder's fields."""
    dims = read_decoder_dims(arch, text, top)
    if arch == "DeepseekV3ForCausalLM" and dims.mla is None:
        raise KeyError("kv_lora_rank")
    return ModelShape(
        name=name, architecture=arch,
        vocab_size=dims.vocab_size, hidden_size=dims.hidden_size,
        num_layers=dims.num_layers, num_heads=dims.num_heads,
        num_kv_heads=dims.num_kv_heads, head_dim=dims.head_dim,
        intermediate_size=dims.intermediate_size,
        tie_word_embeddings=dims.tie_word_embeddings,
        qkv_bias=dims.qkv_bias, o_bias=dims.o_bias, qk_norm=dims.qk_norm,
        dtype=_dtype(text, top), fp8_block=_fp8_block(top) or _fp8_block(text),
        max_position_embeddings=dims.max_position_embeddings,
        mla=dims.mla, moe=_moe(arch, text), mtp_layers=int(text.get("num_nextn_predict_layers") or 0),
    )


def _moe(arch: str, text: dict[str, Any]) -> MoEShape | None:
    """The routed experts as the engine reads them (`expert_layout`), plus what only the plan
    needs: the shared expert's width and DeepSeek's router bias."""
    layout = expert_layout(arch, text)
    if layout is None:
        return None
    if layout.num_experts < 1:
        raise PlanError(f"config.json of {arch} has no routed experts")
    shared, router_bias = 0, False
    if arch == "DeepseekV3ForCausalLM":
        shared = int(text.get("n_shared_experts") or 0) * layout.intermediate_size
        router_bias = text.get("topk_method") == "noaux_tc"
    elif arch == "Llama4ForConditionalGeneration":
        shared = layout.intermediate_size  # one shared expert as wide as a routed one
    return MoEShape(num_experts=layout.num_experts, top_k=layout.top_k,
                    expert_intermediate=layout.intermediate_size, shared_intermediate=shared,
                    layers=frozenset(i for i, routed in enumerate(layout.moe_layers) if routed),
                    router_bias=router_bias)


def _llama4(config: dict[str, Any], name: str) -> ModelShape:
    """Llama 4: the text decoder from `text_config`; the vision tower counted apart."""
    text = config["text_config"]
    shape = _decoder(text, config, "LlamaForCausalLM", name)
    intermediate = int(text["intermediate_size"])  # the experts'; dense layers' is intermediate_size_mlp
    moe = _moe("Llama4ForConditionalGeneration", text)
    vision = config.get("vision_config")
    return ModelShape(**{
        **shape.__dict__,
        "architecture": "Llama4ForConditionalGeneration",
        "intermediate_size": int(text.get("intermediate_size_mlp") or intermediate),
        "qkv_bias": False, "o_bias": False,
        "moe": moe,
        "vision": VisionShape(_llama4_vision_params(vision, shape.hidden_size)) if vision else None,
    })


def _llama4_vision_params(vision: dict[str, Any], text_hidden: int) -> int:
    """Parameters of Llama4VisionModel + the multimodal projector (HF modeling_llama4)."""
    hidden = int(vision["hidden_size"])
    inter = int(vision["intermediate_size"])
    patch = int(vision["patch_size"])
    side = int(vision["image_size"]) // patch
    layer = (4 * (hidden * hidden + hidden)  # q, k, v, o with biases
             + inter * hidden + inter + hidden * inter + hidden  # fc1, fc2 with biases
             + 4 * hidden)  # two LayerNorms, weight and bias
    adapter_in = int(hidden / float(vision["pixel_shuffle_ratio"]) ** 2)
    proj_in, proj_out = int(vision["projector_input_dim"]), int(vision["projector_output_dim"])
    return (int(vision["num_channels"]) * patch * patch * hidden  # unfold patch embedding
            + hidden  # class embedding
            + (side * side + 1) * hidden  # positional embedding
            + 4 * hidden  # layernorm_pre / layernorm_post, weight and bias
            + int(vision["num_hidden_layers"]) * layer
            + adapter_in * proj_in + proj_in * proj_out  # pixel-shuffle MLP
            + int(vision["vision_output_dim"]) * text_hidden)  # multi_modal_projector
