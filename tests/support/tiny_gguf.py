"""Tiny GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them.

`write_gguf(path, ...)` makes random HF-layout weights for a tiny Llama or Qwen2, writes them
to a `.gguf` (q/k rows permuted for Llama, norms and biases F32, matrices in the requested
type) with the metadata and a tiny byte-level BPE vocabulary, and returns the original float
weights to compare against. A helper module, not a conftest: the tests import from it, which
pytest's default (prepend) import mode allows for a test's own directory.

The `gguf` package can quantize F16/BF16 and the legacy Q4_0..Q8_0 types but has no encoder
for the K-quants (it only dequantizes them), so `encode` packs Q2_K..Q6_K
super-blocks by hand, following the bit layout of `gguf.quants`' reference decoders. The
encoders are simple (no llama.cpp importance search), so their error is a bit above a real
quantizer's, but the dequantized values come from the reference decoder like any real file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

Q = GGMLQuantizationType
QK_K = 256

# Every matrix row is a multiple of 256 long, so each type (K-quants included) applies to all.
HIDDEN = 256
INTERMEDIATE = 512
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
CONTEXT = 512
EPS = {"llama": 1e-5, "qwen2": 1e-6}
ROPE_THETA = {"llama": 500000.0, "qwen2": 1000000.0}



def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character table (`bytes_to_unicode`), in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


# A byte-level BPE vocabulary: the 256 byte symbols, three merges and one control token.
_BYTE_SYMBOLS = _byte_symbols()
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = [*_BYTE_SYMBOLS, "Ġt", "he", "Ġthe", "<|endoftext|>"]
EOS_ID = len(TOKENS) - 1
VOCAB = len(TOKENS)

_HF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    """llama.cpp's tensor name for an HF parameter name."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    _, _, layer, *module, suffix = hf.split(".")
    return f"blk.{layer}.{_HF_LAYER_NAMES['.'.join(module)]}.{suffix}"


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute`: rotate-half rows -> interleaved pairs."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def hf_weights(arch: str, tied: bool, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights in HF layout (names, shapes, rotate-half q/k rows)."""
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    weights = {"model.embed_tokens.weight": matrix(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm()
        weights[p + "self_attn.q_proj.weight"] = matrix(HEADS * HEAD_DIM, HIDDEN)
        weights[p + "self_attn.k_proj.weight"] = matrix(KV_HEADS * HEAD_DIM, HIDDEN)
        weights[p + "self_attn.v_proj.weight"] = matrix(KV_HEADS * HEAD_DIM, HIDDEN)
        if arch == "qwen2":
            for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                bias = rng.standard_normal(rows * HEAD_DIM) * 0.1
                weights[p + f"self_attn.{proj}_proj.bias"] = bias.astype(np.float32)
        weights[p + "self_attn.o_proj.weight"] = matrix(HIDDEN, HEADS * HEAD_DIM)
        weights[p + "post_attention_layernorm.weight"] = norm()
        weights[p + "mlp.gate_proj.weight"] = matrix(INTERMEDIATE, HIDDEN)
        weights[p + "mlp.up_proj.weight"] = matrix(INTERMEDIATE, HIDDEN)
        weights[p + "mlp.down_proj.weight"] = matrix(HIDDEN, INTERMEDIATE)
    weights["model.norm.weight"] = norm()
    if not tied:
        weights["lm_head.weight"] = matrix(VOCAB, HIDDEN)
    return weights


# --- K-quant encoders (the inverse of gguf.quants' Q2_K..Q6_K decoders) -------------------


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _nonzero(x: np.ndarray) -> np.ndarray:
    return np.where(x == 0, 1.0, x)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(len(x), 2)


def _affine(sub: np.ndarray, qmax: int, smax: int) -> tuple[np.ndarray, ...]:
    """x ~= d*sc*q - dmin*m per sub-block (q in 0..qmax, sc/m in 0..smax), as Q2_K/Q4_K/Q5_K."""
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (np.maximum(sub.max(-1), 0.0) - lo) / qmax
    d = _f16(scale.max(-1) / smax)
    dmin = _f16((-lo).max(-1) / smax)
    sc = np.clip(np.ceil(scale / _nonzero(d)[:, None]), 0, smax)
    mn = np.clip(np.round(-lo / _nonzero(dmin)[:, None]), 0, smax)
    step = (d[:, None] * sc)[..., None]
    q = np.round((sub + (dmin[:, None] * mn)[..., None]) / _nonzero(step))
    return d, dmin, sc.astype(np.uint8), mn.astype(np.uint8), np.clip(q, 0, qmax).astype(np.uint8)


def _symmetric(sub: np.ndarray, qlo: int, qhi: int, smax: int) -> tuple[np.ndarray, ...]:
    """x ~= d*sc*q per sub-block, the largest-magnitude value mapped to qlo (as Q3_K/Q6_K)."""
    pick = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    scale = pick / qlo
    d = _f16(np.abs(scale).max(-1) / smax)
    sc = np.clip(np.round(scale / _nonzero(d)[:, None]), -smax, smax)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.round(sub / _nonzero(step)), qlo, qhi)
    return d, sc.astype(np.int8), q.astype(np.int8)


def _bits(values: np.ndarray, width: int) -> np.ndarray:
    """Pack values[..., s, k] (s = slot) into bytes[..., k] at bit offset s*width."""
    shifts = (np.arange(values.shape[-2]) * width).astype(np.uint8)[:, None]
    return np.bitwise_or.reduce(values.astype(np.uint8) << shifts, axis=-2).astype(np.uint8)


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12-byte packing of eight 6-bit scales and mins (see Q4_K.get_scale_min)."""
    return np.concatenate(
        [sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
         (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)],
        axis=1,
    )


def _encode_blocks(blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    n = len(blocks)
    if qtype in (Q.Q4_K, Q.Q5_K):
        bits = 4 if qtype == Q.Q4_K else 5
        d, dmin, sc, mn, q = _affine(blocks.reshape(n, 8, 32), (1 << bits) - 1, 63)
        qs = _bits((q & 0xF).reshape(n, 4, 2, 32), 4).reshape(n, 128)
        parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_scales_k4(sc, mn)]
        if bits == 5:
            parts.append(_bits(q >> 4, 1))  # bit i of byte k: sub-block i, element k
        return np.concatenate([*parts, qs], axis=1)
    if qtype == Q.Q2_K:
        d, dmin, sc, mn, q = _affine(blocks.reshape(n, 16, 16), 3, 15)
        qs = _bits(q.reshape(n, 2, 4, 32), 2).reshape(n, 64)
        return np.concatenate([sc | (mn << 4), qs, _f16_bytes(d), _f16_bytes(dmin)], axis=1)
    if qtype == Q.Q3_K:
        d, sc, q = _symmetric(blocks.reshape(n, 16, 16), -4, 3, 31)
        u = (sc + 32).astype(np.uint8)
        v = (q + 4).astype(np.uint8).reshape(n, QK_K)  # q = (v & 3) - 4 * (1 - (v >> 2))
        hmask = _bits((v >> 2).reshape(n, 8, 32), 1)
        qs = _bits((v & 3).reshape(n, 2, 4, 32), 2).reshape(n, 64)
        scales = np.concatenate(
            [(u[:, :8] & 0xF) | ((u[:, 8:] & 0xF) << 4), _bits((u >> 4).reshape(n, 4, 4), 2)],
            axis=1,
        )
        return np.concatenate([hmask, qs, scales, _f16_bytes(d)], axis=1)
    if qtype == Q.Q6_K:
        d, sc, q = _symmetric(blocks.reshape(n, 16, 16), -32, 31, 127)
        v = (q + 32).astype(np.uint8).reshape(n, QK_K)
        ql = _bits((v & 0xF).reshape(n, 2, 2, 64), 4).reshape(n, 128)
        qh = _bits((v >> 4).reshape(n, 2, 4, 32), 2).reshape(n, 64)
        return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)
    raise NotImplementedError(qtype.name)


K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def encode(array: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Stored GGUF data for a float array: float arrays for F32/F16, raw block bytes otherwise."""
    if qtype not in K_QUANTS:
        return quantize(array, qtype)
    rows = array.reshape(-1, QK_K).astype(np.float32)
    encoded = _encode_blocks(rows, qtype)
    return encoded.reshape(*array.shape[:-1], -1)


# --- writing a file -----------------------------------------------------------------------


@dataclass
class TinyGGUF:
    path: Path
    arch: str
    weights: dict[str, np.ndarray]  # HF names, HF layout, float32
    types: dict[str, GGMLQuantizationType] = field(default_factory=dict)  # HF name -> stored


def write_gguf(
    path: Path,
    arch: str = "llama",
    qtype: GGMLQuantizationType = Q.F32,
    *,
    tied: bool | None = None,
    seed: int = 0,
    type_for: Callable[[str], GGMLQuantizationType] | None = None,
    extra_metadata: Callable[[GGUFWriter], None] | None = None,
    extra_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
) -> TinyGGUF:
    """A tiny GGUF: 1-D tensors F32 (as llama.cpp stores them), matrices in `qtype`."""
    tied = arch == "qwen2" if tied is None else tied
    weights = hf_weights(arch, tied, seed)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(ROPE_THETA[arch])
    writer.add_layer_norm_rms_eps(EPS[arch])
    if arch == "llama":
        writer.add_vocab_size(VOCAB)  # llama.cpp writes it for Llama, not for Qwen2
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "llama-bpe")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * (VOCAB - 1) + [3])  # 1 NORMAL, 3 CONTROL
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(EOS_ID)
    writer.add_eos_token_id(EOS_ID)
    if extra_metadata is not None:
        extra_metadata(writer)

    types = {}
    for name, array in weights.items():
        stored = array
        if arch == "llama" and ".q_proj." in name:
            stored = permute_qk(array, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            stored = permute_qk(array, KV_HEADS)
        chosen = Q.F32 if array.ndim == 1 else (type_for(name) if type_for else qtype)
        types[name] = chosen
        writer.add_tensor(gguf_name(name), encode(stored, chosen), raw_dtype=chosen)
    for name, (array, chosen) in (extra_tensors or {}).items():
        writer.add_tensor(name, array, raw_dtype=chosen)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path, arch, weights, types)



def write_metadata_only(path: Path, arch: str, **meta: int | float) -> Path:
    """A GGUF with only `{arch}.*` metadata and no tensors: enough for hf_config and errors."""
    writer = GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, int):
            writer.add_uint32(f"{arch}.{key}", value)
        else:
            writer.add_float32(f"{arch}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
