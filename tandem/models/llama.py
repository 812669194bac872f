"""The Llama decoder family: Llama 2/3.x, SmolLM2, and the base of Mistral, Qwen2 and Qwen3.

The differences between these families are configuration (biases, q/k norm, head_dim,
RoPE scaling, tied head), so one implementation serves all, with thin named subclasses.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from tandem.config import ModelConfig
from tandem.distributed.expert_parallel import ExpertParallel
from tandem.distributed.pipeline_parallel import PipelineStage
from tandem.distributed.tensor_parallel import SINGLE_RANK, TensorParallel
from tandem.kernels.base import AttentionBackend, AttentionMetadata
from tandem.layers.attention import PagedAttention
from tandem.layers.embedding import LMHead, VocabEmbedding
from tandem.layers.int4_experts import FIELDS as INT4_FIELDS
from tandem.layers.linear import GateUpLinear, MergedLinear, RowParallelLinear
from tandem.layers.mla import MultiLatentAttention
from tandem.layers.moe import FusedMoE
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.platform.profiling import profiled

_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
# The decoder's linears a W4A16 checkpoint may store as INT4 (not a routed expert's)
_DECODER_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp|mlp\.shared_experts)\.(q|k|v|o|gate|up|down)_proj\.weight$")

# checkpoint projection name -> (merged module name, shard index)
STACKED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LayerStack(Protocol):
    """Runs every decoder layer at once for the steps it takes (tandem/models/decode_stack.py)."""

    def takes(self, hidden: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> bool: ...

    def __call__(self, hidden: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor],
                 kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor: ...


class DecoderAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, tp: TensorParallel = SINGLE_RANK
    ) -> None:
        super().__init__()
        # Under tensor parallelism this rank computes its share of the heads, dealt by KV
        # group: a KV head goes with the query heads that read it.
        head_dim = self.head_dim = cfg.head_dim
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        kv_start, self.num_kv_heads = (n // head_dim for n in tp.part(cfg.num_key_value_heads, head_dim))
        self.num_heads = self.num_kv_heads * group
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        q_part = (kv_start * group * head_dim, self.q_size)
        kv_part = (kv_start * head_dim, self.kv_size)
        q_full, kv_full = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_full, kv_full, kv_full], cfg.qkv_bias, tp,
                                     parts=[q_part, kv_part, kv_part])
        self.o_proj = RowParallelLinear(q_full, cfg.hidden_size, cfg.o_proj_bias, tp, part=q_part)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, backend)

    def forward(
        self, angles: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata, residual: torch.Tensor,
    ) -> torch.Tensor:
        """`residual` + attention output (the add fused into o_proj)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        # q and k heads sit side by side in the fused projection: rotate them in one pass.
        qk = self.rotary.rotate_(angles, qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size), residual)


class DecoderMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual` + MLP output (the add fused into down_proj; with 8-bit weights, the
        passes between the two projections fused into one)."""
        fused = self.gate_up_proj.gated_down(self.down_proj, x, residual)
        return fused if fused is not None else self.down_proj(self.gate_up_proj(x), residual)


def make_attention(
    cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, tp: TensorParallel = SINGLE_RANK
) -> nn.Module:
    """Multi-head latent attention for MLA models (DeepSeek-V3, Kimi-K2), else the GQA one."""
    if cfg.mla is not None:
        return MultiLatentAttention(cfg.mla, cfg.hidden_size, cfg.num_attention_heads, cfg.rms_norm_eps,
                                    cfg.rope, rotary, backend, cfg.qkv_bias, tp)
    return DecoderAttention(cfg, rotary, backend, tp)


def make_mlp(cfg: ModelConfig, layer: int, tp: TensorParallel = SINGLE_RANK,
             ep: ExpertParallel | None = None) -> nn.Module:
    """The layer's MLP: the experts where the config makes this layer MoE (sharded whole over
    `ep` under expert parallelism), else the dense one."""
    if cfg.moe is not None and cfg.moe.moe_layers[layer]:
        return FusedMoE(cfg.moe, cfg.hidden_size, tp, ep, int4_experts=cfg.int4_experts)
    return DecoderMLP(cfg, tp)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, tp: TensorParallel = SINGLE_RANK,
        layer: int = 0, ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = make_attention(cfg, rotary, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_mlp(cfg, layer, tp, ep)

    def forward(
        self, angles: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        with profiled("attention"):
            hidden = self.self_attn(angles, self.input_layernorm(hidden), kv_cache, meta, residual=hidden)
        return self.mlp(self.post_attention_layernorm(hidden), residual=hidden)


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no weights, keeps checkpoint names aligned."""


class DecoderBody(nn.Module):
    """Embedding, layers and final norm; under pipeline parallelism only this stage's layers
    are built (the others are `MissingLayer`s), the embedding only on the first stage and the
    final norm only on the last."""

    def __init__(
        self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, tp: TensorParallel = SINGLE_RANK,
        stage: PipelineStage | None = None, ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        stage = stage or PipelineStage.whole(cfg.num_hidden_layers)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp) if stage.is_first else None
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, rotary, backend, tp, i, ep) if stage.owns_layer(i) else MissingLayer()
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if stage.is_last else None


class LlamaForCausalLM(nn.Module):
    # Checkpoint names of a MoE layer's experts (MoE families set them; see mixtral.py):
    # the MLP module's name, and each expert's projections -> gate / up / down.
    moe_module = "mlp"
    expert_projections = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int, dtype: torch.dtype,
        tp: TensorParallel = SINGLE_RANK, stage: PipelineStage | None = None, ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.stage = stage = stage or PipelineStage.whole(cfg.num_hidden_layers)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, dtype)
        self.model = DecoderBody(cfg, self.rotary, backend, tp, stage, ep)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp) if stage.is_last else None
        if cfg.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.tie_to(self.model.embed_tokens)
        self._own_layers = tuple(self.model.layers[stage.start_layer : stage.end_layer])  # not a submodule
        # EAGLE-3 drafts read the residual stream entering these layers (set by its proposer);
        # each forward then leaves them, concatenated, in `aux_hidden` [T, len * hidden].
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None
        # The digest of the key divisors folded into the weights at load ("": none), which the
        # KV layout declares (models/key_divisors.py).
        self.key_divisors = ""
        # Small decode steps through every layer in one C call, where the worker attached it
        # (tandem/models/decode_stack.py).
        self.decode_stack: LayerStack | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states [T, hidden] for the flat batch; under pipeline
        parallelism a stage after the first starts from the previous stage's `hidden`, and a
        stage before the last returns its un-normed output for the next."""
        if self.model.embed_tokens is not None:
            hidden = self.model.embed_tokens(input_ids)
        assert hidden is not None, "a stage after the first needs the previous stage's hidden states"
        angles = self.rotary.angles(positions)
        if self.aux_hidden_layers:
            return self._forward_keeping_aux(angles, hidden, kv_caches, meta)
        if self.decode_stack is not None and self.decode_stack.takes(hidden, kv_caches, meta):
            hidden = self.decode_stack(hidden, angles, kv_caches, meta)
            return hidden if self.model.norm is None else self.model.norm(hidden)
        for layer, kv_cache in zip(self._own_layers, kv_caches, strict=True):
            hidden = layer(angles, hidden, kv_cache, meta)
        return hidden if self.model.norm is None else self.model.norm(hidden)

    def _forward_keeping_aux(self, angles: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                             kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        kept = []
        start = self.stage.start_layer
        for index, (layer, kv_cache) in enumerate(zip(self._own_layers, kv_caches, strict=True), start):
            if index in self.aux_hidden_layers:
                kept.append(hidden)
            hidden = layer(angles, hidden, kv_cache, meta)
        self.aux_hidden = torch.cat(kept, dim=-1)
        return hidden if self.model.norm is None else self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        return self.lm_head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """Each row's greedy token without the fp32 logits: through the head's bounded bf16
        copy where it has one (layers/bounded_greedy.py), else the argmax of the head's own
        products on the CPU (`LMHead.greedy_ids`); None: compute the logits."""
        head = self.lm_head
        if head is None or head.shard.tp.split:
            return None
        if head.bounded_greedy is not None:
            return head.bounded_greedy.tokens(hidden)
        if hidden.device.type != "cpu":
            return None
        return head.greedy_ids(hidden, getattr(self, "layer_ops", None)).tolist()

    def holds_weight(self, name: str) -> bool:
        """Whether this rank keeps checkpoint tensor `name` (pipeline stages keep their own
        layers; the embedding lives on the first stage, the norm and head on the last, and a
        tied head on the last stage reads the embedding's tensor)."""
        stage = self.stage
        if not stage.split:
            return True
        layer = _LAYER_NAME.match(name)
        if layer is not None:
            return stage.owns_layer(int(layer.group(1)))
        if name.startswith("model.embed_tokens."):
            return stage.is_first or (stage.is_last and self.config.tie_word_embeddings)
        if name.startswith(("model.norm.", "lm_head.")):
            return stage.is_last
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into the (merged) parameters; returns names loaded."""
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or not self.holds_weight(name):
                continue
            if (name == "model.embed_tokens.weight" and self.config.tie_word_embeddings
                    and self.lm_head is not None and self.model.embed_tokens is None):
                self.lm_head.load("weight", tensor)  # the last stage's copy of a tied head
                loaded.add(name)
                continue
            if self._load_moe(modules, name, tensor):
                loaded.add(name)
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            module_path, _, param = name.rpartition(".")
            owner_path, _, proj = module_path.rpartition(".")
            if proj in STACKED_PROJECTIONS and module_path not in modules:  # merged here (MLA keeps q_proj)
                merged, shard = STACKED_PROJECTIONS[proj]
                modules[f"{owner_path}.{merged}"].load(param, tensor, shard)
            elif hasattr(modules.get(module_path), "load"):  # linears, embedding, head: they shard
                modules[module_path].load(param, tensor)
            else:
                target = self.get_parameter(name)
                if target.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint {tuple(tensor.shape)} vs model {tuple(target.shape)}")
                target.data.copy_(tensor)
            loaded.add(name)
        return loaded

    def _load_moe(self, modules: dict[str, nn.Module], name: str, tensor: torch.Tensor) -> bool:
        """An expert's projection or a router of a MoE layer: loaded into the stacked experts."""
        marker = f".{self.moe_module}."
        if marker not in name:
            return False
        owner, _, rest = name.partition(marker)
        moe = modules.get(f"{owner}.mlp")
        if not isinstance(moe, FusedMoE):
            return False
        parts = rest.split(".")
        if parts[0] == "shared_experts":
            return False  # an ordinary gate/up + down MLP, loaded by the generic path
        if parts[0] == "gate" and parts[-1] == "weight":
            moe.gate.data.copy_(tensor)
        elif parts[0] == "gate" and parts[-1] == "e_score_correction_bias" and moe.correction_bias is not None:
            moe.correction_bias.data.copy_(tensor)
        elif parts[0] == "experts" and len(parts) == 4 and parts[2] in self.expert_projections:
            moe.load_expert(int(parts[1]), self.expert_projections[parts[2]], tensor, field=parts[3])
        else:
            raise ValueError(f"{name}: not a weight of a mixture-of-experts layer this model knows")
        return True

    def _attention_weight_names(self, prefix: str) -> set[str]:
        cfg = self.config
        if cfg.mla is not None:
            queries = ["q_proj"] if cfg.mla.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
            names = {f"{prefix}.{p}.weight" for p in [*queries, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]}
            names.add(f"{prefix}.kv_a_layernorm.weight")
            if cfg.mla.q_lora_rank is not None:
                names.add(f"{prefix}.q_a_layernorm.weight")
            if cfg.qkv_bias:
                names |= {f"{prefix}.{p}.bias" for p in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")
                          if p != "q_a_proj" or cfg.mla.q_lora_rank is not None}
            return names
        names = set()
        for proj in ("q_proj", "k_proj", "v_proj"):
            names.add(f"{prefix}.{proj}.weight")
            if cfg.qkv_bias:
                names.add(f"{prefix}.{proj}.bias")
        names.add(f"{prefix}.o_proj.weight")
        if cfg.o_proj_bias:
            names.add(f"{prefix}.o_proj.bias")
        if cfg.qk_norm:
            names |= {f"{prefix}.q_norm.weight", f"{prefix}.k_norm.weight"}
        return names

    def expected_weight_names(self) -> set[str]:
        return {name for name in self._all_weight_names() if self.holds_weight(name)}

    def _all_weight_names(self) -> set[str]:
        cfg = self.config
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not cfg.tie_word_embeddings:
            names.add("lm_head.weight")
        for i in range(cfg.num_hidden_layers):
            prefix = f"model.layers.{i}"
            names |= {f"{prefix}.input_layernorm.weight", f"{prefix}.post_attention_layernorm.weight"}
            names |= self._attention_weight_names(f"{prefix}.self_attn")
            if cfg.moe is not None and cfg.moe.moe_layers[i]:
                moe = f"{prefix}.{self.moe_module}"
                names.add(f"{moe}.gate.weight")
                fields = INT4_FIELDS if cfg.int4_experts else ("weight",)
                names |= {f"{moe}.experts.{e}.{proj}.{field}"
                          for e in range(cfg.moe.num_experts) for proj in self.expert_projections for field in fields}
                if cfg.moe.correction_bias:
                    names.add(f"{moe}.gate.e_score_correction_bias")
                if cfg.moe.num_shared_experts:
                    names |= {f"{moe}.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
                continue
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names.add(f"{prefix}.mlp.{proj}.weight")
                if cfg.mlp_bias:
                    names.add(f"{prefix}.mlp.{proj}.bias")
        return self._as_stored(names)

    def _as_stored(self, names: set[str]) -> set[str]:
        """A W4A16 checkpoint's INT4 linears hold their three tensors in place of `weight`."""
        cfg = self.config
        if cfg.weight_quantization is None:
            return names
        stored = set()
        for name in names:
            module = name.removesuffix(".weight")
            if _DECODER_LINEAR.match(name) and cfg.int4_linear(module):
                stored |= {f"{module}.{field}" for field in INT4_FIELDS}
            else:
                stored.add(name)
        return stored
