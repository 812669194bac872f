"""An HF `config.json` read into the few numbers a memory plan needs (`ModelShape`).

The plan never loads weights, so everything it knows about a model comes from here: the
dimensions, which layers are MoE, whether attention is GQA or MLA, and the dtype the
checkpoint ships in (including DeepSeek-style FP8 block quantisation and compressed-tensors'
packed integer weights, quant.py). Multimodal wrappers (Llama 4, Kimi K2.5) are read as their
text decoder, with the vision tower counted apart (`VisionShape`). Each supported
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
from tandem.sizing.quant import CompressedTensors, read_compressed_tensors

# The architectures the plan reads, by family. Kimi-K2 ships as DeepseekV3ForCausalLM, Kimi K2.5
# as KimiK25ForConditionalGeneration: a DeepseekV3ForCausalLM under `text_config` + MoonViT.
DENSE_GQA = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED = (*DENSE_GQA, "Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM",
             "Llama4ForConditionalGeneration", "KimiK25ForConditionalGeneration")
# Where the module names tensors.py gives (HF's `model.layers.N.self_attn.q_proj`,
# `model.layers.N.mlp.experts.E.up_proj`, `lm_head`) are the checkpoint's, so compressed-tensors'
# name rules can be matched against them.
COMPRESSED_TENSORS_ARCHS = (*DENSE_GQA, "DeepseekV3ForCausalLM")

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
    """A vision tower + projector, counted apart: tandem serves the text decoder only.

    `loaded_by_vllm`: vLLM's model class builds it on every rank, so its column counts it
    (Kimi K2.5); False keeps it out of both columns (Llama 4, as planned before)."""

    params: int
    name: str = "vision tower"
    loaded_by_vllm: bool = False


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
    int_quant: CompressedTensors | None = None  # compressed-tensors packed integer weights
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
        if arch == "KimiK25ForConditionalGeneration":
            return _kimi_k25(config, name)
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


def _quantization(arch: str, *sources: dict[str, Any]
                  ) -> tuple[tuple[int, int] | None, CompressedTensors | None]:
    """(FP8 block, compressed-tensors scheme) of the first `quantization_config` among
    `sources` (a wrapper's top level, then its text_config); (None, None) if there is none."""
    quant = next((s["quantization_config"] for s in sources if s.get("quantization_config")), None)
    if not quant:
        return None, None
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        if arch not in COMPRESSED_TENSORS_ARCHS:
            raise PlanError(f"compressed-tensors checkpoints of {arch} are not supported by the memory "
                            f"plan (only {', '.join(COMPRESSED_TENSORS_ARCHS)}, whose module names it "
                            "matches the quantization rules against); pass --dtype to plan it unquantised")
        return None, read_compressed_tensors(quant)
    if method != "fp8" or not quant.get("weight_block_size"):
        raise PlanError(f"quantization {method!r} is not supported by the memory plan (only FP8 with "
                        "weight_block_size, as DeepSeek-V3 ships, and compressed-tensors pack-quantized "
                        "integers, as Kimi K2.5 ships); pass --dtype to plan the model unquantised")
    rows, cols = quant["weight_block_size"]
    return (int(rows), int(cols)), None


def _decoder(text: dict[str, Any], top: dict[str, Any], arch: str, name: str) -> ModelShape:
    """Every family but Llama 4's wrapper: the dict `text` holds the decoder's fields."""
    dims = read_decoder_dims(arch, text, top)
    if arch == "DeepseekV3ForCausalLM" and dims.mla is None:
        raise KeyError("kv_lora_rank")
    fp8_block, int_quant = _quantization(arch, top, text)
    return ModelShape(
        name=name, architecture=arch,
        vocab_size=dims.vocab_size, hidden_size=dims.hidden_size,
        num_layers=dims.num_layers, num_heads=dims.num_heads,
        num_kv_heads=dims.num_kv_heads, head_dim=dims.head_dim,
        intermediate_size=dims.intermediate_size,
        tie_word_embeddings=dims.tie_word_embeddings,
        qkv_bias=dims.qkv_bias, o_bias=dims.o_bias, qk_norm=dims.qk_norm,
        dtype=_dtype(text, top), fp8_block=fp8_block, int_quant=int_quant,
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
    if shape.int_quant is not None:  # its experts are fused 3-D tensors, not Linear modules
        raise PlanError("compressed-tensors checkpoints of Llama4ForConditionalGeneration are not supported "
                        "by the memory plan; pass --dtype to plan it unquantised")
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


def _kimi_k25(config: dict[str, Any], name: str) -> ModelShape:
    """Kimi K2.5: a DeepSeek-V3 decoder under `text_config` (the wrapper's ids and its copy of
    the quantization_config on top), and MoonViT + the patch-merger projector beside it."""
    text = config["text_config"]
    shape = _decoder(text, config, "DeepseekV3ForCausalLM", name)
    vision = config.get("vision_config")
    return ModelShape(**{
        **shape.__dict__,
        "architecture": "KimiK25ForConditionalGeneration",
        "vision": VisionShape(_moonvit_params(vision, shape.hidden_size), "MoonViT vision tower + projector",
                              loaded_by_vllm=True) if vision else None,
    })


def _moonvit_params(vision: dict[str, Any], text_hidden: int) -> int:
    """Parameters of Kimi K2.5's MoonViT and its patch-merger projector, as the checkpoint
    stores them (`vision_tower.*`, `mm_projector.*`)."""
    for key, known in (("pos_emb_type", "divided_fixed"), ("mm_projector_type", "patchmerger")):
        if vision.get(key, known) != known:
            raise PlanError(f"Kimi K2.5 vision_config {key} {vision[key]!r} is not supported by the memory "
                            f"plan (only {known!r})")
    hidden = int(vision["vt_hidden_size"])
    inter = int(vision["vt_intermediate_size"])
    patch = int(vision["patch_size"])
    block = (3 * hidden * hidden + 3 * hidden  # wqkv with bias
             + hidden * hidden + hidden  # wo
             + inter * hidden + inter + hidden * inter + hidden  # mlp.fc0, mlp.fc1
             + 4 * hidden)  # norm0, norm1: LayerNorm weight and bias
    tower = (3 * patch * patch * hidden + hidden  # patch_embed.proj: a Conv2d over RGB, with bias
             # the learned 2-D position embedding (its temporal part is a fixed sin-cos buffer)
             + int(vision["init_pos_emb_height"]) * int(vision["init_pos_emb_width"]) * hidden
             + int(vision["vt_num_hidden_layers"]) * block
             + 2 * hidden)  # encoder.final_layernorm
    mm_hidden = int(vision.get("mm_hidden_size") or hidden)
    merge_h, merge_w = vision.get("merge_kernel_size") or (2, 2)
    merged = mm_hidden * int(merge_h) * int(merge_w)  # 2 x 2 patches concatenated
    out = int(vision.get("text_hidden_size") or text_hidden)
    projector = (2 * mm_hidden  # pre_norm: LayerNorm weight and bias
                 + merged * merged + merged  # proj.0
                 + out * merged + out)  # proj.2 (proj.1 is the GELU)
    return tower + projector
