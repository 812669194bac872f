"""GGUF checkpoints: metadata -> HF config, quantized tensors -> dequantized HF-named tensors.

llama.cpp stores Llama-family q/k projections with their rows permuted for its interleaved
RoPE; we undo that so the weights match transformers' rotate-half layout. Qwen2/Qwen3 GGUFs
are stored unpermuted. Dequantization uses the `gguf` package's reference implementations.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

logger = logging.getLogger(__name__)

SUPPORTED_QUANT_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    )
)
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_PERMUTED_QK = {"llama", "mistral"}
_CONTROL_TOKEN = 3  # llama.cpp's token type for special tokens
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# The normalizer HF's own tokenizer applies for a GGUF pre-tokenizer, which transformers' GGUF
# conversion leaves out: Qwen2's tokenizer NFC-normalizes its input, so without this a
# decomposed "é" (e + U+0301) tokenizes differently than under the original model.
_NORMALIZERS = {"qwen2": {"type": "NFC"}}
# Tokens a family ends a generation with besides the GGUF's eos. Qwen's instruct models end
# a turn with <|im_end|> (their GGUF eos) and a document with <|endoftext|>; their HF
# generation_config lists both, and llama.cpp stops on both.
_END_TOKENS = {"qwen2": ("<|im_end|>", "<|endoftext|>")}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name; None for tensors we derive ourselves."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def reverse_qk_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of q/k rows (its convert script's `permute`)."""
    half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


class GGUFCheckpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        try:
            self.reader = GGUFReader(str(self.path))
        except (ValueError, OSError) as exc:
            # The reader's own messages ("GGUF magic invalid", numpy view errors on a truncated
            # file) do not say which file they are about.
            raise ValueError(f"{self.path}: not a readable GGUF file ({exc})") from exc
        self.arch = str(_field(self.reader, "general.architecture", ""))
        if self.arch not in _ARCHITECTURES:
            raise ValueError(
                f"{self.path.name}: unsupported GGUF architecture {self.arch!r}; "
                f"supported: {', '.join(_ARCHITECTURES)}"
            )
        unsupported = sorted(
            {t.tensor_type.name for t in self.reader.tensors if t.tensor_type not in SUPPORTED_QUANT_TYPES}
        )
        if unsupported:
            raise ValueError(
                f"{self.path.name}: unsupported GGUF tensor types {unsupported}; "
                f"supported: {sorted(t.name for t in SUPPORTED_QUANT_TYPES)}"
            )

    def _meta(self, key: str, default: Any = None) -> Any:
        return _field(self.reader, f"{self.arch}.{key}", default)

    def _required(self, key: str) -> int:
        """An integer hyperparameter with no sensible default; a clear error when it is absent,
        not a bare `int(None)` TypeError."""
        value = self._meta(key)
        if value is None:
            raise ValueError(
                f"{self.path.name}: GGUF metadata lacks {self.arch}.{key}, "
                f"which a {self.arch} model needs"
            )
        return int(value)

    def hf_config(self) -> dict[str, Any]:
        """An HF `config.json` equivalent built from the GGUF metadata."""
        names = {t.name for t in self.reader.tensors}
        heads = self._required("attention.head_count")
        hidden = self._required("embedding_length")
        tokens = _field(self.reader, "tokenizer.ggml.tokens") or []
        config: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "vocab_size": int(self._meta("vocab_size", len(tokens))),
            "hidden_size": hidden,
            "intermediate_size": self._required("feed_forward_length"),
            "num_hidden_layers": self._required("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._meta("attention.head_count_kv", heads)),
            "head_dim": int(self._meta("attention.key_length", hidden // heads)),
            "max_position_embeddings": int(self._meta("context_length", 4096)),
            "rms_norm_eps": float(self._meta("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._meta("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": _field(self.reader, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _field(self.reader, "tokenizer.ggml.eos_token_id"),
        }
        scaling_type = self._meta("rope.scaling.type")
        if scaling_type == "linear":
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(self._meta("rope.scaling.factor", 1.0))}
        if "rope_freqs.weight" in names:
            # Llama 3.1+ GGUFs carry the scaled frequencies as a tensor; its largest entry
            # is the scaling factor, the other llama3 parameters are the published defaults.
            freqs = self.tensor_by_name("rope_freqs.weight")
            config["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": float(freqs.max()),
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        return config

    @property
    def pre_tokenizer(self) -> str:
        """llama.cpp's name for the tokenizer's pre-tokenization ("qwen2", "llama-bpe", ...)."""
        return str(_field(self.reader, "tokenizer.ggml.pre", ""))

    def tokenizer_normalizer(self) -> dict[str, Any] | None:
        """The tokenizer.json normalizer the original tokenizer has, when the GGUF implies one."""
        return _NORMALIZERS.get(self.pre_tokenizer)

    def end_of_generation_ids(self) -> list[int]:
        """eos, eot and eom when the GGUF names them, and the family's other end tokens.

        Written to generation_config.json, which read_model_config merges into the stop set.
        """
        ids = [_field(self.reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
        extra = _END_TOKENS.get(self.pre_tokenizer, ())
        if extra:
            tokens = _field(self.reader, "tokenizer.ggml.tokens") or []
            types = _field(self.reader, "tokenizer.ggml.token_type") or []
            control = {token: index for index, token in enumerate(tokens)
                       if index < len(types) and types[index] == _CONTROL_TOKEN and token in extra}
            ids += [control.get(token) for token in extra]
        return sorted({int(i) for i in ids if i is not None})

    def tensor_by_name(self, name: str) -> np.ndarray:
        for tensor in self.reader.tensors:
            if tensor.name == name:
                return self._dequantize(tensor)
        raise KeyError(name)

    @staticmethod
    def _dequantize(tensor: Any) -> np.ndarray:
        data = dequantize(tensor.data, tensor.tensor_type)
        return np.asarray(data, dtype=np.float32).reshape(tuple(reversed([int(d) for d in tensor.shape])))

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, float32 array) for every weight, q/k rows restored to HF order."""
        config = self.hf_config()
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            if name is None:
                if tensor.name != "rope_freqs.weight":
                    logger.warning("ignoring GGUF tensor %s", tensor.name)
                continue
            array = self._dequantize(tensor)
            if self.arch in _PERMUTED_QK:
                if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
                    array = reverse_qk_permutation(array, config["num_attention_heads"])
                elif name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
                    array = reverse_qk_permutation(array, config["num_key_value_heads"])
            yield name, array

    @property
    def num_tensors(self) -> int:
        return len(self.reader.tensors)
