"""The EAGLE-3 draft head: one decoder layer that reads the target's hidden states.

EAGLE-3 (Li et al., 2025) guesses with a single Llama decoder layer fed two things per
position: the embedding of the next token and a hidden state. For the first guess that hidden
state is the target's own: three of its residual streams (the inputs of layers 2, L//2 and
L-3 by default) concatenated and projected by `fc` to the head's width. For further guesses it
is the head's previous output, so the head runs on itself without the target. The layer's
query/key/value projections therefore take twice the hidden width:
`cat(input_layernorm(embed), hidden_norm(hidden))`, and the residual is the hidden input.

Alignment: the row at position i takes (token i+1, hidden of position i) and its logits predict
token i+2; rotary positions are i, so the head's KV lives at the target's positions and can use
the target's block tables (one layer, the target's slots, a separate tensor).

The head's LM head covers a reduced "draft vocabulary" (the tokens the target says most);
`d2t` maps a draft id to its target id as an offset (target = draft + d2t[draft]) and
`compute_logits` scatters into the target's vocabulary with -inf elsewhere, so a proposer can
take an argmax in target ids directly.

Checkpoints use the HF EAGLE-3 layout (SpecForge, the EAGLE repository, vLLM):
`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, optionally `embed_tokens` (else the
target's embedding is shared).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.config import KVCacheSpec, RopeConfig
from tandem.kernels.base import AttentionBackend, AttentionMetadata
from tandem.layers.attention import PagedAttention
from tandem.layers.embedding import LMHead, VocabEmbedding
from tandem.layers.linear import GateUpLinear, Linear, MergedLinear
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.llama import STACKED_PROJECTIONS

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")

_IGNORED = ("t2d", "rotary_emb.inv_freq")  # present in checkpoints, unused at inference


@dataclass(frozen=True)
class Eagle3Config:
    """The head's architecture, read from its HF `config.json`."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool = False
    use_aux_hidden_state: bool = True  # False: the head reads one hidden state, no fc
    aux_layer_ids: tuple[int, ...] | None = None  # None: (2, L // 2, L - 3)
    attention_bias: bool = False
    mlp_bias: bool = False
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    num_layers: int = 1  # what the KV cache needs: one layer

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def kv_spec(self) -> KVCacheSpec:
        return KVCacheSpec(num_planes=2, num_heads=self.num_key_value_heads, head_dim=self.head_dim)

    @property
    def fc_input_size(self) -> int:
        return 3 * self.target_hidden_size

    def aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose *input* residual streams feed the head (vLLM's convention:
        the checkpoint's `eagle_aux_hidden_state_layer_ids`, else 2, L // 2 and L - 3)."""
        if self.aux_layer_ids:
            bad = [i for i in self.aux_layer_ids if not 0 <= i < num_target_layers]
            if bad:
                raise ValueError(f"EAGLE-3 aux layers {bad} are outside the target's {num_target_layers} layers")
            return self.aux_layer_ids
        if num_target_layers < 4:
            raise ValueError(f"EAGLE-3 needs a target of at least 4 layers, not {num_target_layers}")
        return (2, num_target_layers // 2, num_target_layers - 3)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Eagle3Config:
        archs = hf.get("architectures") or []
        if not any(a in EAGLE3_ARCHITECTURES for a in archs):
            raise ValueError(f"not an EAGLE-3 head: architectures {archs or '(none given)'}, "
                             f"expected one of {', '.join(EAGLE3_ARCHITECTURES)}")
        layers = int(hf.get("num_hidden_layers", 1))
        if layers != 1:
            raise ValueError(f"EAGLE-3 heads of {layers} layers are not supported (only 1)")
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        vocab = int(hf["vocab_size"])
        eagle = hf.get("eagle_config") or {}
        aux = hf.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            rope=RopeConfig.from_hf(hf),
            vocab_size=vocab,
            draft_vocab_size=int(hf.get("draft_vocab_size") or vocab),
            target_hidden_size=int(hf.get("target_hidden_size") or hidden),
            norm_before_residual=bool(hf.get("norm_before_residual", False)),
            use_aux_hidden_state=bool(eagle.get("use_aux_hidden_state", True)),
            aux_layer_ids=tuple(int(i) for i in aux) if aux else None,
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hf_config=hf,
        )

    @classmethod
    def from_hf_dir(cls, path: Path | str) -> Eagle3Config:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        return cls.from_hf(json.loads(config_path.read_text()))


class Eagle3Attention(nn.Module):
    """GQA attention whose q/k/v read the [embed, hidden] concatenation (2 x hidden wide)."""

    def __init__(self, cfg: Eagle3Config, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(2 * cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.attention_bias)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, backend)

    def forward(self, angles: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, residual: torch.Tensor) -> torch.Tensor:
        """`residual` + attention output (the add fused into o_proj)."""
        num_tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = self.rotary.rotate_(angles, qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = self.attn(q, k, v.view(num_tokens, self.num_kv_heads, self.head_dim), kv_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size), residual)


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), residual)


class Eagle3MidLayer(nn.Module):
    """The checkpoint's `midlayer`: norms of both inputs, attention, MLP."""

    def __init__(self, cfg: Eagle3Config, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, rotary, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, angles: tuple[torch.Tensor, torch.Tensor], embeds: torch.Tensor, hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        # vLLM's `norm_before_residual`: the residual stream starts from the normed hidden
        # state instead of the raw one (some checkpoints were trained that way).
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        hidden = self.self_attn(angles, x, kv_cache, meta, residual=residual)
        return self.mlp(self.post_attention_layernorm(hidden), residual=hidden)


class Eagle3Head(nn.Module):
    """An EAGLE-3 head over tandem's paged KV cache (one layer's cache tensor)."""

    def __init__(self, cfg: Eagle3Config, backend: AttentionBackend, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, dtype)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = Linear(cfg.fc_input_size, cfg.hidden_size) if cfg.use_aux_hidden_state else None
        self.midlayer = Eagle3MidLayer(cfg, self.rotary, backend)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(cfg.draft_vocab_size, cfg.hidden_size)
        # target id of each draft id: arange + d2t (identity until a checkpoint says otherwise)
        self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size), persistent=False)
        self.to(dtype).eval()

    def aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        return self.config.aux_layers(num_target_layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The layer's output [T, hidden] (before the final norm): the next guess's `hidden`.

        `hidden` rows are the target's concatenated aux hidden states (3 x target hidden wide,
        projected by fc here) or the head's own previous output (hidden wide); one call takes
        one kind."""
        hidden = self.project_hidden(hidden)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        return self.midlayer(self.rotary.angles(positions), embeds, hidden, kv_cache, meta)

    def project_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's concatenated aux hidden states through `fc` (vLLM's
        `combine_hidden_states`); hidden-wide rows (the head's own outputs) pass unchanged. A
        caller mixing both kinds in one batch projects the target's rows here first."""
        width = hidden.shape[-1]
        cfg = self.config
        if self.fc is not None and width == cfg.fc_input_size and width != cfg.hidden_size:
            return self.fc(hidden)
        if width == cfg.hidden_size:
            return hidden
        expected = f"{cfg.fc_input_size} (the target's 3 aux hidden states) or " if self.fc is not None else ""
        raise ValueError(f"EAGLE-3 head got hidden states {width} wide; expected {expected}{cfg.hidden_size}")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, target vocab] logits: the draft vocabulary's, -inf for every other token."""
        draft = self.lm_head(self.norm(hidden))
        logits = draft.new_full((draft.shape[0], self.config.vocab_size), float("-inf"))
        logits[:, self.draft_to_target] = draft
        return logits

    def load_weights(self, hf_dir: Path | str, target_embedding: torch.Tensor | None = None) -> None:
        """Fill the head from the checkpoint in `hf_dir` (HF EAGLE-3 names, with or without a
        `model.` prefix); without `embed_tokens.weight` there, `target_embedding` (the target's
        [vocab, hidden] embedding) is shared. Any missing, unknown or misshapen tensor is an error."""
        tensors = read_checkpoint(Path(hf_dir))
        names = {_canonical(name): name for name in tensors}
        unknown = sorted(names.keys() - self.expected_weight_names() - {"embed_tokens.weight", "d2t"}
                         - {n for n in names if n.endswith(_IGNORED)})
        if unknown:
            raise ValueError(f"EAGLE-3 checkpoint in {hf_dir} has tensors this head does not know: {unknown[:5]}")
        missing = sorted(self.expected_weight_names() - names.keys())
        if missing:
            raise ValueError(f"EAGLE-3 checkpoint in {hf_dir} lacks {len(missing)} weights, e.g. {missing[:3]}")
        modules = dict(self.named_modules())
        with torch.no_grad():
            for name in self.expected_weight_names():
                self._load_one(modules, name, tensors[names[name]])
            self._load_embedding(tensors.get(names.get("embed_tokens.weight", "")), target_embedding, hf_dir)
            self._load_d2t(tensors.get(names.get("d2t", "")), hf_dir)

    def expected_weight_names(self) -> set[str]:
        cfg = self.config
        names = {"norm.weight", "lm_head.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                 "midlayer.post_attention_layernorm.weight"}
        attn = ("q_proj", "k_proj", "v_proj", "o_proj")
        mlp = ("gate_proj", "up_proj", "down_proj")
        names |= {f"midlayer.self_attn.{p}.weight" for p in attn}
        names |= {f"midlayer.mlp.{p}.weight" for p in mlp}
        if cfg.attention_bias:
            names |= {f"midlayer.self_attn.{p}.bias" for p in attn}
        if cfg.mlp_bias:
            names |= {f"midlayer.mlp.{p}.bias" for p in mlp}
        if self.fc is not None:
            names.add("fc.weight")
        return names

    def _load_one(self, modules: dict[str, nn.Module], name: str, tensor: torch.Tensor) -> None:
        module_path, _, param = name.rpartition(".")
        owner, _, proj = module_path.rpartition(".")
        try:
            if proj in STACKED_PROJECTIONS:
                merged, shard = STACKED_PROJECTIONS[proj]
                modules[f"{owner}.{merged}"].load(param, tensor.to(self.lm_head.weight.dtype), shard)
            elif hasattr(modules[module_path], "load"):
                modules[module_path].load(param, tensor.to(self.lm_head.weight.dtype))
            else:
                target = self.get_parameter(name)
                if target.shape != tensor.shape:
                    raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs head {tuple(target.shape)}")
                target.copy_(tensor)
        except ValueError as exc:
            raise ValueError(f"EAGLE-3 tensor {name}: {exc}") from None

    def _load_embedding(self, tensor: torch.Tensor | None, target_embedding: torch.Tensor | None,
                        hf_dir: Path | str) -> None:
        if tensor is None:
            if target_embedding is None:
                raise ValueError(f"EAGLE-3 checkpoint in {hf_dir} has no embed_tokens.weight: "
                                 "pass the target's embedding (target_embedding) to share it")
            tensor = target_embedding
        try:
            self.embed_tokens.load("weight", tensor.to(self.embed_tokens.weight.dtype))
        except ValueError as exc:
            raise ValueError(f"EAGLE-3 embedding (vocab_size {self.config.vocab_size}, hidden_size "
                             f"{self.config.hidden_size}): {exc}") from None

    def _load_d2t(self, d2t: torch.Tensor | None, hf_dir: Path | str) -> None:
        cfg = self.config
        if d2t is None:
            if cfg.draft_vocab_size != cfg.vocab_size:
                raise ValueError(f"EAGLE-3 checkpoint in {hf_dir} has a draft vocabulary of {cfg.draft_vocab_size} "
                                 f"tokens but no d2t map to the target's {cfg.vocab_size}")
            return
        if d2t.shape != (cfg.draft_vocab_size,) or d2t.dtype.is_floating_point:
            raise ValueError(f"EAGLE-3 d2t must be integer [{cfg.draft_vocab_size}], not "
                             f"{d2t.dtype} {tuple(d2t.shape)}")
        targets = torch.arange(cfg.draft_vocab_size) + d2t.long()
        if targets.min() < 0 or targets.max() >= cfg.vocab_size or targets.unique().numel() != targets.numel():
            raise ValueError(f"EAGLE-3 d2t does not map the draft vocabulary one-to-one into the target's "
                             f"{cfg.vocab_size} tokens")
        self.draft_to_target.copy_(targets)


def _canonical(name: str) -> str:
    """Checkpoint name -> this head's: drop a `model.` prefix; `layers.0.` is the midlayer."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def read_checkpoint(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head's checkpoint: *.safetensors, else pytorch_model.bin."""
    files = sorted(hf_dir.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for path in files:
            for name, tensor in load_file(path).items():
                if name in tensors:
                    raise ValueError(f"{name} is in two weight files of {hf_dir}")
                tensors[name] = tensor
        return tensors
    legacy = hf_dir / "pytorch_model.bin"
    if legacy.is_file():
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin weights in {hf_dir}")
