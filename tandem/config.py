"""Frozen configuration dataclasses, one per concern.

Each is built once at start-up (from CLI flags or `LLM(...)` keyword arguments) and passed
explicitly to whatever needs it; nothing reads configuration from globals.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from tandem.checkpoint_quantization import WeightQuantization
from tandem.platform.cpu_modes import (
    EXACT_NOTE,
    CpuFeatures,
    choose_cpu_mode,
    exact_requested,
    is_quantized_checkpoint,
)
from tandem.platform.device import (
    resolve_block_size,
    resolve_chunk_blocks,
    resolve_device,
    resolve_dtype,
)
from tandem.sizing.experts import expert_layout
from tandem.sizing.kv import KV_INT8_SCALE_BYTES  # noqa: F401 - the int8 row's scale, for the engine
from tandem.sizing.memory import DEFAULT_MEMORY_UTILIZATION
from tandem.sizing.shape import MLAShape, read_decoder_dims
from tandem.sizing.units import parse_memory_size  # noqa: F401 - the config's size flags parse with it

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration",  # its text backbone: DeepSeek-V3 under text_config
)
# Multimodal wrappers whose language model tandem runs: architecture -> (the text backbone's
# architecture, the prefix of its tensors in the checkpoint).
TEXT_BACKBONES = {"KimiK25ForConditionalGeneration": ("DeepseekV3ForCausalLM", "language_model.")}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ASYNC_SCHEDULING = ("auto", "on", "off")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "int8")  # the model's dtype, bf16, float8 e4m3, int8 + a scale
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn (DeepSeek-V3, Kimi-K2, Qwen long-context): the ramp between interpolated and
    # extrapolated frequencies, and the cos/sin magnitude; None lets the factors decide.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeConfig:
        """Read both the transformers v5 `rope_parameters` and the older `rope_scaling`."""
        params = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {}
        merged = {**scaling, **params}
        theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported RoPE scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                merged.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
            ),
            beta_fast=float(merged.get("beta_fast") or 32.0),
            beta_slow=float(merged.get("beta_slow") or 1.0),
            mscale=_optional_float(merged.get("mscale")),
            mscale_all_dim=_optional_float(merged.get("mscale_all_dim")),
            attention_factor=_optional_float(merged.get("attention_factor")),
            truncate=bool(merged.get("truncate", True)),
        )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token leaves in one layer's KV cache.

    Standard attention keeps a key and a value per KV head (`num_planes` 2); multi-head
    latent attention (DeepSeek-V3, Kimi-K2) keeps one compressed latent per token, shared by
    every head (`num_planes` 1, one "head" as wide as the latent plus its rotary part). The
    block pool, the prefix cache, the PD handoff and the KV tiers move blocks of whatever this
    describes, so a new cache layout is a new spec, not a new code path.
    """

    num_planes: int
    num_heads: int
    head_dim: int

    def values_per_token(self, num_layers: int) -> int:
        return num_layers * self.num_planes * self.num_heads * self.head_dim


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): keys and values are rebuilt from
    a `kv_lora_rank` latent per token plus one shared `qk_rope_head_dim` rotary key, and that
    is all the cache keeps (`latent_dim` values per token per layer, whatever the head count)."""

    q_lora_rank: int | None  # None: queries come from one projection, no low-rank step
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rotary pairs (x0, x1), (x2, x3)...: permuted at load time

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MLAConfig | None:
        shape = read_decoder_dims("DeepseekV3ForCausalLM", hf).mla
        return None if shape is None else cls.from_shape(shape, hf)

    @classmethod
    def from_shape(cls, shape: MLAShape, hf: dict[str, Any]) -> MLAConfig:
        """The dimensions the plan reads too, plus how the checkpoint orders rotary pairs."""
        return cls(
            q_lora_rank=shape.q_lora_rank,
            kv_lora_rank=shape.kv_lora_rank,
            qk_nope_head_dim=shape.qk_nope_head_dim,
            qk_rope_head_dim=shape.qk_rope_head_dim,
            v_head_dim=shape.v_head_dim,
            rope_interleave=bool(hf.get("rope_interleave", True)),
        )


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: a router picks `top_k` of `num_experts` SwiGLU experts per
    token (layers/moe.py). Written for Mixtral and Qwen3-MoE (softmax scores) and for
    DeepSeek-V3 / Kimi-K2 (sigmoid scores, a selection-only bias, group-limited choice,
    scaled weights, shared experts, the first layers dense)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool = True  # renormalise the k chosen weights to sum to 1
    scoring: str = "softmax"  # or "sigmoid"
    n_group: int = 1  # experts in `n_group` groups; only the best `topk_group` are eligible
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # a learned per-expert bias added for selection only
    num_shared_experts: int = 0  # experts every token goes through, as one wider MLP
    moe_layers: tuple[bool, ...] = ()  # per layer: MoE (True) or the dense MLP (False)

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be between 1 and the {self.num_experts} experts")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported expert scoring {self.scoring!r}; supported: softmax, sigmoid")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"n_group {self.n_group} must divide the {self.num_experts} experts and topk_group "
                f"{self.topk_group} be between 1 and n_group"
            )
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"num_experts_per_tok {self.top_k} exceeds the experts of {self.topk_group} groups")

    @classmethod
    def from_hf(cls, arch: str, hf: dict[str, Any]) -> MoeConfig | None:
        # the expert count and the MoE layers as the memory plan reads them (tandem/sizing)
        layout = expert_layout(arch, hf)
        if layout is None:
            return None
        common = {"num_experts": layout.num_experts, "top_k": layout.top_k,
                  "intermediate_size": layout.intermediate_size, "moe_layers": layout.moe_layers}
        if arch == "MixtralForCausalLM":
            return cls(**common)
        if arch == "Qwen3MoeForCausalLM":
            return cls(**common, norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
        if arch == "DeepseekV3ForCausalLM":  # Kimi-K2 too
            return cls(**common, norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                       scoring=hf.get("scoring_func", "sigmoid"), n_group=int(hf.get("n_group") or 1),
                       topk_group=int(hf.get("topk_group") or 1),
                       routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                       correction_bias=True, num_shared_experts=int(hf.get("n_shared_experts") or 0))
        return None


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the runner needs, read from an HF `config.json` dict."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    mla: MLAConfig | None = None
    moe: MoeConfig | None = None
    # compressed-tensors INT4 weights (Kimi K2.5's routed experts); None: the run dtype's
    weight_quantization: WeightQuantization | None = None
    # A multimodal wrapper's text backbone: its tensors' prefix in the checkpoint (tandem maps
    # `language_model.model.*` to `model.*`), and whether the checkpoint has a vision tower
    # (not loaded: a request with images is refused).
    weight_prefix: str = ""
    has_vision_tower: bool = False
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def int4_experts(self) -> bool:
        """Whether the routed experts are stored as INT4 levels (loaded and run packed)."""
        if self.weight_quantization is None or self.moe is None or True not in self.moe.moe_layers:
            return False
        layer = self.moe.moe_layers.index(True)
        return self.weight_quantization.quantizes(*self._names(f"model.layers.{layer}.mlp.experts.0.gate_proj"))

    def _names(self, name: str) -> tuple[str, ...]:
        return (self.weight_prefix + name, name) if self.weight_prefix else (name,)

    def int4_linear(self, module: str) -> bool:
        """Whether checkpoint Linear `module` (e.g. model.layers.0.self_attn.q_proj, without a
        wrapper's prefix) is stored as INT4 levels (layers/int4_linear.py)."""
        return self.weight_quantization is not None and self.weight_quantization.quantizes(*self._names(module))

    def _check_quantized_modules(self) -> None:
        """INT4 is computed for routed experts and for the decoder's linears (attention
        projections, dense and shared MLPs). Refused by name: an INT4 LM head, MLA's
        projections (the latent attention reads them as dense matrices, and its rotary rows
        are reordered on load), and a merged projection (q/k/v, gate/up) only partly INT4."""
        quant = self.weight_quantization
        if quant is None:
            return
        refused = ["lm_head"]
        merged: list[list[str]] = []
        for layer in range(self.num_hidden_layers):
            prefix = f"model.layers.{layer}"
            if self.mla:
                queries = ("q_proj",) if self.mla.q_lora_rank is None else ("q_a_proj", "q_b_proj")
                refused += [f"{prefix}.self_attn.{p}" for p in (*queries, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")]
            else:
                merged.append([f"{prefix}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")])
            moe_layer = self.moe is not None and self.moe.moe_layers[layer]
            mlp = f"{prefix}.mlp.shared_experts" if moe_layer else f"{prefix}.mlp"
            if not moe_layer or (self.moe and self.moe.num_shared_experts):
                merged.append([f"{mlp}.gate_proj", f"{mlp}.up_proj"])
        quantized = [name for name in refused if self.int4_linear(name)]
        if quantized:
            raise ValueError(f"this checkpoint's INT4 scheme quantizes {quantized[0]} (and {len(quantized) - 1} "
                             "more); tandem computes INT4 for routed experts and the decoder's linears, not for "
                             "the LM head or MLA's projections")
        for group in merged:
            if len({self.int4_linear(name) for name in group}) > 1:
                raise ValueError(f"this checkpoint's INT4 scheme quantizes some of {', '.join(group)} but not all; "
                                 "tandem runs them as one merged projection")

    @property
    def kv_spec(self) -> KVCacheSpec:
        if self.mla is not None:
            return KVCacheSpec(num_planes=1, num_heads=1, head_dim=self.mla.latent_dim)
        return KVCacheSpec(num_planes=2, num_heads=self.num_key_value_heads, head_dim=self.head_dim)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or []
        wrapper = next((a for a in archs if a in TEXT_BACKBONES), None)
        if wrapper is not None:
            return cls._text_backbone(wrapper, hf)
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or '(none given)'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        # The dimensions come from the reader `tandem plan memory` uses, so both agree.
        dims = read_decoder_dims(arch, hf)
        if not dims.intermediate_size:
            raise KeyError("intermediate_size")
        mla = MLAConfig.from_shape(dims.mla, hf) if dims.mla is not None else None
        # MLA's rotary tables are built over the rope part of a query/key head only.
        head_dim = mla.qk_rope_head_dim if mla is not None else dims.head_dim
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        use_sliding = hf.get("use_sliding_window", True) and hf.get("sliding_window")
        config = cls(
            architecture=arch,
            model_type=hf.get("model_type", ""),
            vocab_size=dims.vocab_size,
            hidden_size=dims.hidden_size,
            intermediate_size=dims.intermediate_size,
            num_hidden_layers=dims.num_layers,
            num_attention_heads=dims.num_heads,
            num_key_value_heads=dims.num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=dims.max_position_embeddings,
            rope=RopeConfig.from_hf(hf),
            tie_word_embeddings=dims.tie_word_embeddings,
            qkv_bias=dims.qkv_bias,
            o_proj_bias=dims.o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=dims.qk_norm,
            sliding_window=int(use_sliding) if use_sliding else None,
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            mla=mla,
            moe=MoeConfig.from_hf(arch, hf),
            weight_quantization=WeightQuantization.from_hf(hf),
            hf_config=hf,
        )
        config._check_quantized_modules()
        return config

    @classmethod
    def _text_backbone(cls, wrapper: str, hf: dict[str, Any]) -> ModelConfig:
        """A multimodal checkpoint's language model (Kimi K2.5: DeepSeek-V3 under
        `text_config`), with the wrapper's token ids and quantization where the text config
        lacks them."""
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{wrapper} config has no text_config")
        backbone, prefix = TEXT_BACKBONES[wrapper]
        merged = {**text, "architectures": [backbone]}
        for key in ("eos_token_id", "bos_token_id", "quantization_config"):
            if key in hf and (key == "eos_token_id" or key not in text):
                merged[key] = hf[key]  # the top level carries generation_config's eos ids
        base = cls.from_hf(merged)
        config = replace(base, architecture=wrapper, model_type=hf.get("model_type", base.model_type),
                         weight_prefix=prefix, has_vision_tower=bool(hf.get("vision_config")), hf_config=hf)
        config._check_quantized_modules()
        return config


@dataclass(frozen=True)
class CacheConfig:
    # None: 64 tokens on a CPU, 16 on a GPU (platform/device.py says why), settled by EngineConfig.
    block_size: int | None = None
    kv_cache_memory_bytes: int | None = None  # None: derived from free memory at start
    enable_prefix_caching: bool = True
    # "auto": the model's dtype; "bfloat16": bf16 rows (an fp32 model's cache at half the
    # bytes); "fp8": float8 e4m3 with per-layer power-of-two scales measured at start
    # (worker/kv_scales.py), a byte a value; "int8": rows of int8 values and their scale
    # (kernels/kv_format.py). Every backend reads each; config_checks.py says what else takes them.
    kv_cache_dtype: str = "auto"
    # GPU: the share of each device the weights and KV cache may take; the activation peak and
    # the CUDA context must fit in the rest (worker/kv_sizing.py, as `tandem plan memory`).
    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION
    # CPU: map the KV budget lazily, its pages committed at their first write, instead of
    # committing it whole at start (worker/model_runner.py says why the default commits).
    lazy_kv_cache: bool = False


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # Grammar-constrained requests: append the tokens a grammar forces (a JSON key, a call's
    # envelope) without sampling them, computed with the next step's token (tandem/structured).
    jump_forward: bool = True
    # Launch step N+1 before step N's tokens reach the host, its decode inputs taken from step
    # N's samples on the device (EngineConfig.runs_ahead says when "auto" does).
    async_scheduling: str = "auto"  # auto | on | off


# Compact weight copies a small step may read instead of the run dtype's (layers/linear.py).
DECODE_WEIGHT_FORMATS = ("float16", "bfloat16", "int4", "float32")


@dataclass(frozen=True)
class LoadConfig:
    """How the model's weights are loaded and run: dtype, device, threads, weight formats,
    attention backend, CUDA graphs. (The benches' traffic is bench.load_client.TrafficConfig.)"""

    # "auto": bfloat16 on a GPU; on a CPU the fastest dtype measured inside the quality bar on
    # its instructions (tandem/platform/cpu_modes.py), float32 with `exact`. Settled at construction.
    dtype: str = "auto"
    load_format: str = "auto"  # auto | dummy
    seed: int = 0
    cache_dir: str | None = None  # where converted GGUF checkpoints are kept
    num_threads: int | None = None
    # Steps of at most `decode_weights_max_tokens` tokens read a compact copy of the weights
    # (see layers/linear.py SmallStepWeights). "none": exact. "auto": what the CPU's default
    # mode takes (platform/cpu_modes.py), settled with the model by EngineConfig.
    decode_weights: str = "auto"  # auto | none | float16 | bfloat16 | int4 | float32
    decode_weights_max_tokens: int = 2
    # Steps larger than the small-step copy's reach: "int8" multiplies 8-bit weights by 8-bit
    # activations (W8A8, layers/int8.py), twice bf16's multiply-adds per instruction; "w8a16"
    # reads 8-bit weights widened to bf16 on AMX's tiles (kernels/dense_gemm.py), half the
    # bytes; "none": the run dtype's weights; "auto" as for decode_weights.
    quantization: str = "auto"  # auto | none | int8 | w8a16
    # --exact: every "auto" above means the token-identical fp32 path (float32, none, none).
    exact: bool = False
    # Which of dtype / quantization / decode_weights were "auto" (for the start-up line), and
    # what the default mode said of them; both set while settling.
    settled_auto: tuple[str, ...] = field(default=(), compare=False)
    mode_note: str = field(default="", compare=False)
    # Reorder weights into oneDNN's layout on CPU (same arithmetic, faster kernels).
    pack_weights: bool = True
    # Decode attention: "cpu" = the C kernel over the paged cache (kernels/cpu_attention.py),
    # "torch" = gather + batched matmuls, "auto" = the kernel when it compiles here.
    attention_backend: str = "auto"  # auto | cpu | torch | triton
    # Where the model runs: "auto" = a GPU when this torch can drive one, else the CPU.
    device: str = "auto"  # auto | cpu | cuda
    # GPU: run every step eagerly instead of replaying CUDA graphs for decode-only steps.
    enforce_eager: bool = False
    # GPU: the largest decode batch a CUDA graph is captured for (bigger ones run eagerly).
    max_cudagraph_batch: int = 128

    def __post_init__(self) -> None:
        if self.exact and (self.dtype not in ("auto", "float32") or self.quantization not in ("auto", "none")
                           or self.decode_weights not in ("auto", "none", "float32")):
            raise ValueError("--exact is the fp32 path with the checkpoint's weights: drop --dtype, "
                             "--quantization and --decode-weights (or give none or float32), or --exact")
        device = resolve_device(self.device)
        object.__setattr__(self, "device", device)
        if self.dtype == "auto":
            object.__setattr__(self, "settled_auto", (*self.settled_auto, "dtype"))
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, device, self.exact))

    def mode_line(self) -> str:
        """What runs and why, for the start-up log: the default mode's own words when it chose
        everything, else the settings as given (each `auto` one marked)."""
        if self.mode_note:
            return self.mode_note
        if (self.device == "cpu" and self.dtype == "float32" and self.quantization == "none"
                and self.decode_weights in ("none", "float32")):  # the fp32 rows are the checkpoint's own
            return EXACT_NOTE + ("" if self.exact else " (as set)")

        def shown(name: str, value: str) -> str:
            return f"{value}{' (auto)' if name in self.settled_auto else ''}"

        return (f"{shown('dtype', self.dtype)}, quantization {shown('quantization', self.quantization)}, "
                f"decode weights {shown('decode_weights', self.decode_weights)}")

    def settled_for(self, model: str, one_rank: bool, decodes: bool = True) -> LoadConfig:
        """This config with `auto` weight modes replaced by what the default mode takes for
        `model` on this host (platform/cpu_modes.py; none on a GPU, which runs its dtype).
        `decodes`: False for a prefill-only worker, which takes no decode copy."""
        autos = [name for name in ("quantization", "decode_weights") if getattr(self, name) == "auto"]
        if not autos:
            return self
        if self.device != "cpu":  # a GPU runs its dtype
            return replace(self, settled_auto=(*self.settled_auto, *autos), **dict.fromkeys(autos, "none"))
        mode = choose_cpu_mode(CpuFeatures.detect(), is_quantized_checkpoint(model), one_rank,
                               self.exact or exact_requested(), decodes)
        settled = {name: getattr(mode, name) for name in autos}
        if settled.get("decode_weights") == "float32" and self.dtype != "float32":
            settled["decode_weights"] = "none"  # exact's fp32 rows are an fp32 model's own
        # The mode's own words where all of it runs (a CLI settles --dtype auto into argv, so
        # a worker may see the mode's dtype given explicitly).
        note = mode.note if self.dtype == mode.dtype and len(autos) == 2 else ""
        return replace(self, settled_auto=(*self.settled_auto, *autos), mode_note=note, **settled)


ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class KVTransferConfig:
    """KV connectors, and the prefill/decode handoff's settings (tandem/kvcache/connector/pd.py)."""

    # KV connectors chained in front of the local prefix cache, by name (connector/factory.py);
    # empty: none. `tandem serve` always runs "pd", the prefill/decode handoff.
    connectors: tuple[str, ...] = ()
    role: str = "both"  # prefill: serves KV to others; decode: fetches it; both: either
    host: str = "127.0.0.1"  # where this worker's KV source listens
    port: int = 0  # 0: any free port
    hold_timeout: float = 60.0  # kept blocks are freed after this if nobody released them
    fetch_timeout: float = 10.0  # a decode worker computes the prompt itself after this
    shared_memory: bool = False  # KV cache in /dev/shm so same-host peers copy it directly
    # How fetched blocks travel over tcp (kvcache/codec.py): "raw" (the cache's bytes), or
    # "bfloat16" / "int8" / "int4"; a decode worker asks its source for this codec.
    transfer_codec: str = "raw"
    # The cluster secret (tandem/trust): peers sign HTTP requests and KV-port frames with it. A
    # worker without one takes no handoff fields and opens no KV port.
    secret: str | None = field(default=None, repr=False)

    @property
    def serves_kv(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def fetches_kv(self) -> bool:
        return self.role in ("decode", "both")


@dataclass(frozen=True)
class KVTiersConfig:
    """The KV tiers below the device pool (tandem/kvcache/connector/tiers.py); all off by default.

    A chunk of `chunk_blocks` blocks is the unit stored and loaded. CPU memory is written through
    as chunks are computed; the disk and the cluster store are written asynchronously, and only
    for chunks seen in at least `admit_after` requests, or of a request whose first chunk was
    (a conversation's next turn), so one-shot prompts stay out of them.
    """

    cpu_bytes: int = 0  # CPU-memory tier budget; 0: off
    disk_path: str | None = None  # local-disk tier directory; None: off
    disk_bytes: int = 16 << 30
    store_url: str | None = None  # cluster store: redis://host:port, valkey://..., mooncake://...
    chunk_blocks: int | None = None  # None: 256 tokens' worth, settled by EngineConfig
    admit_after: int = 2  # sightings before a chunk may enter disk / cluster; 1: every chunk
    max_concurrent_loads: int = 4
    load_timeout: float = 10.0  # a load not done by then: the prompt is computed instead
    writer_queue_chunks: int = 64  # pending slow-tier writes; beyond, new ones are dropped
    cost_model: bool = True  # False: always load when a tier has the chunk
    # How chunks are kept in every tier (kvcache/codec.py): "raw" (the cache's bytes), or
    # "bfloat16" / "int8" / "int4"; a reader decodes whatever codec a chunk names.
    codec: str = "raw"

    @property
    def enabled(self) -> bool:
        return bool(self.cpu_bytes or self.disk_path or self.store_url)


EXECUTOR_BACKENDS = ("auto", "uni", "mp")


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks run the model, how they split it, and how the engine reaches them
    (executor/, distributed/).

    Ranks are laid out stage-major, as vLLM does: rank = stage * tensor_parallel_size +
    tensor-parallel rank, so a stage's tensor-parallel group is consecutive ranks (one host,
    when ranks_per_node is a multiple of it). Several hosts: `nnodes` nodes of
    world_size / nnodes ranks each; node 0 runs the engine core, the others run headless
    ranks (`tandem rank`) that join it at `master_addr`.
    """

    world_size: int = 1
    # uni: one worker inside the engine core; mp: one process per rank joined by
    # torch.distributed; auto: uni for one rank, mp for more.
    executor_backend: str = "auto"
    # torch.distributed backend: gloo on CPU, nccl on CUDA; auto picks by device.
    distributed_backend: str = "auto"
    # Ranks that split every layer between them (distributed/tensor_parallel.py); 1: each
    # rank holds whole layers.
    tensor_parallel_size: int = 1
    # Stages that split the layers between them (distributed/pipeline_parallel.py); the engine
    # keeps one micro-batch in flight per stage.
    pipeline_parallel_size: int = 1
    # MoE layers: each rank of a tensor-parallel group holds whole experts, a 1/size share of
    # them, and tokens travel to their experts by all-to-all (distributed/expert_parallel.py),
    # instead of every rank holding a slice of every expert.
    enable_expert_parallel: bool = False
    # Several hosts (torch.distributed's usual MASTER_ADDR / MASTER_PORT rendezvous).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (one host only)
    join_timeout: float = 120.0  # seconds for every rank to join before start-up fails

    def __post_init__(self) -> None:
        for name, value in (("--tensor-parallel-size", self.tensor_parallel_size),
                            ("--pipeline-parallel-size", self.pipeline_parallel_size), ("--nnodes", self.nnodes)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        split = self.tensor_parallel_size * self.pipeline_parallel_size
        if split > 1 and self.world_size != split:
            raise ValueError(
                f"--world-size {self.world_size} with --tensor-parallel-size {self.tensor_parallel_size} and "
                f"--pipeline-parallel-size {self.pipeline_parallel_size}: the world is their product, "
                f"{split} ranks (leave --world-size out)"
            )
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("--enable-expert-parallel shards the experts over the tensor-parallel ranks: "
                             "it needs --tensor-parallel-size of at least 2")
        if self.world_size % self.nnodes:
            raise ValueError(f"--nnodes {self.nnodes} does not divide the {self.world_size} ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is not one of the {self.nnodes} nodes")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("several nodes need --master-port (and --master-addr): where the ranks meet")

    @classmethod
    def of(cls, world_size: int = 1, tensor_parallel_size: int = 1, executor_backend: str = "auto",
           **rest: Any) -> ParallelConfig:
        """From the flags: the parallel sizes alone set the world size too."""
        split = tensor_parallel_size * rest.get("pipeline_parallel_size", 1)
        if split > 1 and world_size == 1:
            world_size = split
        return cls(world_size=world_size, executor_backend=executor_backend,
                   tensor_parallel_size=tensor_parallel_size, **rest)

    @property
    def uses_processes(self) -> bool:
        return self.executor_backend == "mp" or (self.executor_backend == "auto" and self.world_size > 1)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def splits_model(self) -> bool:
        """Ranks hold different parts of the model (not whole replicas)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size > 1


SPEC_METHODS = ("ngram", "suffix", "draft_model", "eagle3")
_SPEC_ALIASES = {"draft": "draft_model", "[ngram]": "ngram"}
MAX_SPEC_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (tandem/spec/), in vLLM's `--speculative-config` shape.

    `num_speculative_tokens` is the most draft tokens verified per request per step; with
    `adaptive` (a tandem extension, on by default) the engine picks each request's k per step
    between 0 and that, from its acceptance so far and the measured cost of a token in the
    step (tandem/spec/adaptive.py). Off when `method` is None.
    """

    method: str | None = None
    num_speculative_tokens: int = 0
    model: str | None = None  # draft_model / eagle3: the proposer's weights
    adaptive: bool = True
    # ngram: the longest suffix of n tokens, n in [min, max], found earlier proposes what followed.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # suffix: Arctic Inference's knobs, vLLM's names and defaults, except the global tree
    # keeps 1,000 requests, not 10,000: its nodes are Python objects, and at 10,000 requests
    # (1.2M objects) a full garbage collection pauses the engine for ~0.8 s (0.1 s at 1,000).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # suffix, a tandem extension: before the trees, prompt lookup over the request's own tokens
    # (the earliest occurrence of the longest tail of prompt_lookup_min..max_tree_depth tokens,
    # proposing as much as the trees' length rule allows): a copy goes on where its source goes
    # on, which the trees' most frequent continuation often is not (tandem/spec/suffix.py).
    # false: Arctic's suffix decoding alone.
    suffix_decoding_prompt_lookup: bool = True
    # draft_model / eagle3: the weights the proposer's small forwards (its guesses, a decode's
    # catch-up of one or two tokens) read, as --decode-weights does for the target. A guess
    # only has to be likely, not exact (the target verifies it), and int4 reads a quarter of
    # bf16's bytes: a draft forward costs about half as much, so more of the target's time
    # is saved. "none": the draft runs in the run dtype throughout.
    draft_decode_weights: str = "int4"

    def __post_init__(self) -> None:
        if self.method is None:
            return
        method = _SPEC_ALIASES.get(self.method, self.method)
        object.__setattr__(self, "method", method)
        if method not in SPEC_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {', '.join(SPEC_METHODS)}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in 1..{MAX_SPEC_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if method in ("draft_model", "eagle3") and not self.model:
            raise ValueError(f"speculative method {method!r} needs a \"model\" (the draft's weights)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) and prompt_lookup_max "
                             f"({self.prompt_lookup_max}) must satisfy 1 <= min <= max")
        if self.suffix_decoding_max_tree_depth < 2 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_tree_depth must be >= 2 and "
                             "suffix_decoding_max_cached_requests >= 0")
        if self.draft_decode_weights not in ("none", *DECODE_WEIGHT_FORMATS):
            raise ValueError(f"draft_decode_weights must be none or one of {', '.join(DECODE_WEIGHT_FORMATS)}, "
                             f"got {self.draft_decode_weights!r}")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0 or self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1] and "
                             "suffix_decoding_max_spec_factor > 0")
        if not isinstance(self.suffix_decoding_prompt_lookup, bool):
            raise ValueError("suffix_decoding_prompt_lookup must be true or false, "
                             f"got {self.suffix_decoding_prompt_lookup!r}")
        if (method == "suffix" and self.suffix_decoding_prompt_lookup
                and self.prompt_lookup_min > self.suffix_decoding_max_tree_depth):
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"suffix_decoding_max_tree_depth ({self.suffix_decoding_max_tree_depth}): "
                             "suffix's prompt lookup matches up to that many tokens")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @classmethod
    def from_json(cls, text: str | dict[str, Any] | None) -> SpeculativeConfig:
        """From `--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`."""
        if text is None or text == "":
            return cls()
        if isinstance(text, str):
            try:
                text = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"--speculative-config is not valid JSON: {error}") from None
        if not isinstance(text, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(text) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        if "method" not in text:
            raise ValueError("--speculative-config needs a \"method\"")
        return cls(**text)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    load: LoadConfig = LoadConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    kv_transfer: KVTransferConfig = KVTransferConfig()
    parallel: ParallelConfig = ParallelConfig()
    kv_tiers: KVTiersConfig = KVTiersConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    def __post_init__(self) -> None:
        # The weight modes' `auto` depends on the model (a quantized checkpoint) and the layout.
        one_rank = not self.parallel.splits_model
        decodes = self.kv_transfer.role != "prefill"
        object.__setattr__(self, "load", self.load.settled_for(self.model, one_rank, decodes))
        # The block size's and the tier chunk's `None` depend on the device.
        block_size = resolve_block_size(self.cache.block_size, self.load.device)
        if block_size != self.cache.block_size:
            object.__setattr__(self, "cache", replace(self.cache, block_size=block_size))
        chunk_blocks = resolve_chunk_blocks(self.kv_tiers.chunk_blocks, block_size)
        if chunk_blocks != self.kv_tiers.chunk_blocks:
            object.__setattr__(self, "kv_tiers", replace(self.kv_tiers, chunk_blocks=chunk_blocks))

    @property
    def runs_ahead_possible(self) -> bool:
        """Whether steps can run ahead of their tokens (asynchronous scheduling): one rank in
        this process, no pipeline of micro-batches, no drafts (a draft is proposed from the
        tokens the step before kept, on the host)."""
        parallel = self.parallel
        return (parallel.world_size == 1 and not parallel.uses_processes
                and parallel.pipeline_parallel_size == 1 and self.speculative.method is None)

    @property
    def runs_ahead(self) -> bool:
        """Asynchronous scheduling: the engine launches step N+1 before step N's sampled tokens
        reach the host, each decode's input token taken from step N's samples on the device,
        so the host's scheduling and output handling overlap the device's forward (vLLM's
        --async-scheduling). "auto" turns it on for a GPU, where a batch-1 step's host work is
        ~10% of the step with the device idle; on a CPU the host is the device and nothing
        overlaps. A request whose next step needs its last token on the host (penalties,
        min_tokens still pending, a grammar) waits for it as before (engine/scheduler.py)."""
        choice = self.scheduler.async_scheduling
        if choice == "off" or not self.runs_ahead_possible:
            return False
        return choice == "on" or self.load.device == "cuda"


@dataclass(frozen=True)
class RequestLimits:
    """Per request, on the worker and the router (tandem/edge/limits.py)."""

    max_body_bytes: int = 16 << 20
    body_timeout_s: float = 30.0
    max_messages: int = 4096
    max_tools: int = 512

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024 or self.body_timeout_s <= 0:
            raise ValueError("--max-request-bytes must be >= 1KiB and --body-timeout > 0")
        if self.max_messages < 1 or self.max_tools < 0:
            raise ValueError("--max-messages must be >= 1 and --max-tools >= 0")


# What --override-generation-config may set, with the range each takes (vLLM's flag; its
# max_new_tokens is the max_tokens of a request that names none).
_GENERATION_BOUNDS: dict[str, tuple[type, float, float, bool]] = {
    # name: (type, low, high, low is exclusive)
    "temperature": (float, 0.0, math.inf, False),
    "top_p": (float, 0.0, 1.0, True),
    "top_k": (int, -1, math.inf, False),
    "min_p": (float, 0.0, 1.0, False),
    "repetition_penalty": (float, 0.0, math.inf, True),
    "presence_penalty": (float, -2.0, 2.0, False),
    "frequency_penalty": (float, -2.0, 2.0, False),
    "max_new_tokens": (int, 1, math.inf, False),
}


@dataclass(frozen=True)
class GenerationDefaults:
    """The server's sampling defaults for a request that leaves a field out
    (--override-generation-config, vLLM's flag). Agent harnesses send no temperature (Codex,
    OpenCode) and no max_output_tokens (Codex): without these they sample at 1.0 until the
    context is full, which a small model sometimes does, one rambling turn at a time."""

    values: tuple[tuple[str, float | int], ...] = ()

    @classmethod
    def from_json(cls, text: str | None) -> GenerationDefaults:
        """Parsed and range-checked: an unknown key or a bad value is a ValueError naming it."""
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--override-generation-config is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("--override-generation-config must be a JSON object, e.g. "
                             "'{\"temperature\": 0.7, \"max_new_tokens\": 2048}'")
        values = []
        for name, value in raw.items():
            if name not in _GENERATION_BOUNDS:
                raise ValueError(f"--override-generation-config: {name!r} is not one of "
                                 f"{', '.join(_GENERATION_BOUNDS)}")
            kind, low, high, exclusive = _GENERATION_BOUNDS[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    kind is int and not isinstance(value, int)):
                raise ValueError(f"--override-generation-config: {name} must be a{'n integer' if kind is int else ' number'}")
            if not math.isfinite(value) or not (low < value if exclusive else low <= value) or value > high:
                raise ValueError(f"--override-generation-config: {name} {value} is out of range")
            values.append((name, kind(value)))
        return cls(tuple(values))

    @property
    def max_new_tokens(self) -> int | None:
        return int(dict(self.values)["max_new_tokens"]) if "max_new_tokens" in dict(self.values) else None

    def sampling_fields(self) -> dict[str, float | int]:
        """The request fields these set (all but max_new_tokens, which bounds max_tokens)."""
        return {name: value for name, value in self.values if name != "max_new_tokens"}


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI server around one engine (`tandem serve`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()  # empty: the model argument as given
    api_key: str | None = field(default=None, repr=False)
    # The control plane's bearer token (tandem/trust/access.py); None: the cluster secret's.
    admin_key: str | None = field(default=None, repr=False)
    public_metrics: bool = False  # /metrics, /load, /version open even with keys configured
    # Sequences (prompts x n) accepted but not yet generating; beyond: 429 + Retry-After; 0 = no limit
    max_waiting: int = 512
    max_waiting_tokens: int | None = None  # prompt tokens waiting at once; None: 64 contexts; 0 = no limit
    # max_tokens past what the context leaves: "cap" serves it capped (agent harnesses send
    # 32000 whatever the model), "reject" answers 400 as vLLM does.
    max_tokens_policy: str = "cap"
    tool_call_parser: str | None = None  # None: chosen from the chat template
    reasoning_parser: str | None = None  # None: reasoning stays in the answer text
    engine_start_timeout: float = 900.0  # a first start converts the GGUF; allow for it
    log_level: str = "info"
    limits: RequestLimits = field(default_factory=RequestLimits)
    shutdown_timeout_s: float = 30.0  # SIGTERM: drain this long at most (tandem/edge/drain.py)
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)

    def __post_init__(self) -> None:
        if self.max_tokens_policy not in ("cap", "reject"):
            raise ValueError(f"--max-tokens-policy must be cap or reject, got {self.max_tokens_policy!r}")
