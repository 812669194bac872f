"""GGUFCheckpoint on tiny hand-written GGUF files: tensor types, q/k order, config, errors.

The files come from `write_gguf` (tests/support/tiny_gguf.py), which writes them the way
llama.cpp's converter does, so these tests check tandem's reading against the HF-layout
weights the file was made from, and against transformers' own GGUF loader.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter, RopeScalingType
from gguf.quants import dequantize

from tandem.config import ModelConfig
from tandem.loader.gguf_loader import (
    SUPPORTED_QUANT_TYPES,
    GGUFCheckpoint,
    hf_name,
    reverse_qk_permutation,
)
from tests.support.tiny_gguf import (
    EOS_ID,
    EPS,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    KV_HEADS,
    LAYERS,
    ROPE_THETA,
    VOCAB,
    Q,
    encode,
    gguf_name,
    permute_qk,
    write_gguf,
    write_metadata_only,
)

# Largest relative RMS error (|dequantized - original| over |original|) allowed per stored
# type: about 1.5x the worst each shows on these N(0, 0.02) weights (fixed seeds), so a
# wrong block layout or row order (error ~1.4) cannot pass.
REL_RMS_BOUND = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 5e-3,
    Q.Q8_0: 0.01,
    Q.Q6_K: 0.03,
    Q.Q5_0: 0.065,
    Q.Q5_1: 0.06,
    Q.Q5_K: 0.06,
    Q.Q4_0: 0.13,
    Q.Q4_1: 0.12,
    Q.Q4_K: 0.12,
    Q.Q3_K: 0.24,
    Q.Q2_K: 0.5,
}
TYPES = sorted(REL_RMS_BOUND, key=lambda t: t.value)


def test_every_supported_type_is_covered() -> None:
    assert set(REL_RMS_BOUND) == set(SUPPORTED_QUANT_TYPES)


def _stored_row_order(name: str, arch: str, rows: int) -> np.ndarray:
    """Which HF row each stored row holds (llama.cpp permutes Llama's q/k rows)."""
    order = np.arange(rows)
    if arch == "llama" and ".q_proj." in name:
        return permute_qk(order, HEADS)
    if arch == "llama" and ".k_proj." in name:
        return permute_qk(order, KV_HEADS)
    return order


def _rel_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_tensors_match_original_weights(tmp_path: Path, arch: str, qtype: Q) -> None:
    made = write_gguf(tmp_path / "model.gguf", arch=arch, qtype=qtype)
    got = dict(GGUFCheckpoint(made.path).tensors())

    assert set(got) == set(made.weights)
    for name, want in made.weights.items():
        array = got[name]
        assert array.dtype == np.float32 and array.shape == want.shape, name
        if want.ndim == 1 or qtype == Q.F32:  # norms and biases are F32 in every file
            np.testing.assert_array_equal(array, want, err_msg=name)
            continue
        # Exactly the reference decoding of the stored blocks, rows put back in HF order ...
        order = _stored_row_order(name, arch, want.shape[0])
        reference = np.empty_like(want)
        reference[order] = dequantize(encode(want[order], qtype), qtype)
        np.testing.assert_array_equal(array, reference, err_msg=name)
        # ... and close to the original float weights.
        assert 0 < _rel_rms(array, want) <= REL_RMS_BOUND[qtype], name


def test_mixed_types_in_one_file(tmp_path: Path) -> None:
    """A Q4_K_M-like mix: the types differ per tensor, each read with its own decoder."""
    mix = {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q8_0, "output": Q.Q6_K}
    made = write_gguf(
        tmp_path / "model.gguf",
        arch="llama",
        type_for=lambda name: mix.get(gguf_name(name).split(".")[-2], Q.Q4_K),
    )
    got = dict(GGUFCheckpoint(made.path).tensors())
    assert {t.name for t in made.types.values()} == {"F32", "Q4_K", "Q6_K", "Q8_0"}
    for name, want in made.weights.items():
        assert _rel_rms(got[name], want) <= REL_RMS_BOUND[made.types[name]], name


def test_qk_unpermutation_restores_hf_row_order_exactly(tmp_path: Path) -> None:
    made = write_gguf(tmp_path / "model.gguf", arch="llama", qtype=Q.F32)
    checkpoint = GGUFCheckpoint(made.path)
    got = dict(checkpoint.tensors())
    for layer in range(LAYERS):
        for proj, heads in (("q", HEADS), ("k", KV_HEADS)):
            want = made.weights[f"model.layers.{layer}.self_attn.{proj}_proj.weight"]
            stored = checkpoint.tensor_by_name(f"blk.{layer}.attn_{proj}.weight")
            # The file really holds llama.cpp's interleaved order, not the HF one ...
            assert not np.array_equal(stored, want)
            np.testing.assert_array_equal(stored, permute_qk(want, heads))
            # ... and tensors() hands back the HF order bit for bit.
            np.testing.assert_array_equal(
                got[f"model.layers.{layer}.self_attn.{proj}_proj.weight"], want
            )


@pytest.mark.parametrize(("heads", "shape"), [(4, (256, 64)), (2, (128, 64)), (8, (64,)), (1, (6, 3))])
def test_reverse_qk_permutation_inverts_llama_cpp_permute(heads: int, shape: tuple[int, ...]) -> None:
    weight = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    np.testing.assert_array_equal(reverse_qk_permutation(permute_qk(weight, heads), heads), weight)


def test_qwen2_rows_are_not_permuted(tmp_path: Path) -> None:
    made = write_gguf(tmp_path / "model.gguf", arch="qwen2", qtype=Q.F32)
    checkpoint = GGUFCheckpoint(made.path)
    for proj in ("q", "k", "v"):
        for kind in ("weight", "bias"):
            np.testing.assert_array_equal(
                checkpoint.tensor_by_name(f"blk.0.attn_{proj}.{kind}"),
                made.weights[f"model.layers.0.self_attn.{proj}_proj.{kind}"],
            )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_config(tmp_path: Path, arch: str) -> None:
    made = write_gguf(tmp_path / "model.gguf", arch=arch, qtype=Q.Q8_0)
    config = GGUFCheckpoint(made.path).hf_config()
    expected_arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert config["architectures"] == [expected_arch]
    assert config["model_type"] == arch
    assert config["vocab_size"] == VOCAB  # Qwen2 GGUFs carry no vocab_size: taken from the tokens
    assert config["hidden_size"] == HIDDEN
    assert config["intermediate_size"] == INTERMEDIATE
    assert config["num_hidden_layers"] == LAYERS
    assert config["num_attention_heads"] == HEADS
    assert config["num_key_value_heads"] == KV_HEADS
    assert config["head_dim"] == HEAD_DIM
    assert config["max_position_embeddings"] == 512
    assert config["rope_theta"] == ROPE_THETA[arch]
    assert config["rms_norm_eps"] == pytest.approx(EPS[arch], rel=1e-6)  # stored as float32
    # The Qwen2 file has no output.weight (tied), the Llama one has.
    assert config["tie_word_embeddings"] is (arch == "qwen2")
    assert config["bos_token_id"] == EOS_ID and config["eos_token_id"] == EOS_ID
    assert "rope_scaling" not in config

    model = ModelConfig.from_hf(config)
    assert model.architecture == expected_arch
    assert model.qkv_bias is (arch == "qwen2")
    assert model.tie_word_embeddings is (arch == "qwen2")
    assert model.eos_token_ids == (EOS_ID,)


def test_hf_config_untied_qwen2_and_tied_llama(tmp_path: Path) -> None:
    untied_qwen2 = write_gguf(tmp_path / "a.gguf", arch="qwen2", tied=False)
    assert GGUFCheckpoint(untied_qwen2.path).hf_config()["tie_word_embeddings"] is False
    assert "lm_head.weight" in dict(GGUFCheckpoint(untied_qwen2.path).tensors())
    tied_llama = write_gguf(tmp_path / "b.gguf", arch="llama", tied=True)
    assert GGUFCheckpoint(tied_llama.path).hf_config()["tie_word_embeddings"] is True
    assert "lm_head.weight" not in dict(GGUFCheckpoint(tied_llama.path).tensors())


def test_hf_config_head_dim_from_key_length(tmp_path: Path) -> None:
    """attention.key_length wins over hidden // heads (e.g. Qwen3, Mistral Nemo)."""
    meta = dict(embedding_length=256, feed_forward_length=512, block_count=1, vocab_size=8)
    path = write_metadata_only(tmp_path / "m.gguf", "qwen3", **meta, **{"attention.head_count": 8})
    assert GGUFCheckpoint(path).hf_config()["head_dim"] == 32
    path = write_metadata_only(
        tmp_path / "k.gguf", "qwen3", **meta, **{"attention.head_count": 8, "attention.key_length": 64}
    )
    config = GGUFCheckpoint(path).hf_config()
    assert config["head_dim"] == 64
    assert config["num_key_value_heads"] == 8  # head_count_kv absent: plain multi-head attention
    assert config["architectures"] == ["Qwen3ForCausalLM"]


def test_linear_rope_scaling(tmp_path: Path) -> None:
    def scaling(writer: GGUFWriter) -> None:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    made = write_gguf(tmp_path / "model.gguf", arch="llama", extra_metadata=scaling)
    config = GGUFCheckpoint(made.path).hf_config()
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert ModelConfig.from_hf(config).rope.factor == 4.0


def _llama3_rope_factors(theta: float, dim: int, factor: float) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for Llama 3.1 (low 1, high 4, original 8192)."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / freqs
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < 8192 / 4, 1.0, np.where(wavelen > 8192, factor, mid)).astype(np.float32)


def test_llama3_rope_freqs_tensor(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    factors = _llama3_rope_factors(ROPE_THETA["llama"], HEAD_DIM, 8.0)
    made = write_gguf(tmp_path / "model.gguf", arch="llama", extra_tensors={"rope_freqs.weight": (factors, Q.F32)})
    checkpoint = GGUFCheckpoint(made.path)
    assert checkpoint.hf_config()["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    with caplog.at_level(logging.WARNING, logger="tandem.loader.gguf_loader"):
        names = [name for name, _ in checkpoint.tensors()]
    assert set(names) == set(made.weights)  # rope_freqs is config, not a weight
    assert not caplog.records


def test_unknown_tensor_is_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    extra = {"blk.0.attn_weird.weight": (np.zeros((2, 32), np.float32), Q.F32)}
    made = write_gguf(tmp_path / "model.gguf", arch="llama", extra_tensors=extra)
    with caplog.at_level(logging.WARNING, logger="tandem.loader.gguf_loader"):
        names = {name for name, _ in GGUFCheckpoint(made.path).tensors()}
    assert names == set(made.weights)
    assert "blk.0.attn_weird.weight" in caplog.text


def test_hf_name_mapping() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.11.attn_k.bias") == "model.layers.11.self_attn.k_proj.bias"
    assert hf_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("rope_freqs.weight") is None
    assert hf_name("blk.0.ffn_gate_exps.weight") is None


# --- against transformers' GGUF loader ----------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [("llama", Q.Q4_K), ("llama", Q.F32), ("qwen2", Q.Q5_0)],
    ids=["llama-Q4_K", "llama-F32", "qwen2-Q5_0"],
)
def test_matches_transformers_gguf_loader(tmp_path: Path, arch: str, qtype: Q) -> None:
    """transformers reads the same file with its own name map and q/k un-permutation."""
    transformers = pytest.importorskip("transformers")
    made = write_gguf(tmp_path / "model.gguf", arch=arch, qtype=qtype)
    ours = dict(GGUFCheckpoint(made.path).tensors())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(made.path.parent), gguf_file=made.path.name, dtype=torch.float32
    )
    theirs = model.state_dict()
    tied = "lm_head.weight" not in ours
    assert set(theirs) == set(ours) | ({"lm_head.weight"} if tied else set())
    for name, array in ours.items():
        torch.testing.assert_close(theirs[name], torch.tensor(array), rtol=0, atol=0, msg=name)
    if tied:
        torch.testing.assert_close(theirs["lm_head.weight"], theirs["model.embed_tokens.weight"])
    config = GGUFCheckpoint(made.path).hf_config()
    for key in ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size",
                "num_hidden_layers", "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(model.config, key) == config[key], key
    # Qwen2Config has no head_dim attribute: it is always hidden_size // heads there.
    assert getattr(model.config, "head_dim", HIDDEN // HEADS) == config["head_dim"]


# --- errors -------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"GGUF file not found: .*nope\.gguf"):
        GGUFCheckpoint(tmp_path / "nope.gguf")


def test_unknown_architecture(tmp_path: Path) -> None:
    path = write_metadata_only(tmp_path / "phi.gguf", "phi3", block_count=1)
    with pytest.raises(ValueError, match=r"phi\.gguf: unsupported GGUF architecture 'phi3'") as info:
        GGUFCheckpoint(path)
    for supported in ("llama", "mistral", "qwen2", "qwen3"):
        assert supported in str(info.value)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    # Q8_1 (llama.cpp's activation type) and IQ4_NL are valid GGUF types tandem does not read.
    q8_1 = np.zeros((2, GGML_QUANT_SIZES[Q.Q8_1][1]), np.uint8)  # two rows of one block each
    iq4 = np.zeros((2, GGML_QUANT_SIZES[Q.IQ4_NL][1]), np.uint8)
    made = write_gguf(
        tmp_path / "model.gguf",
        arch="llama",
        qtype=Q.Q4_0,
        extra_tensors={"blk.0.attn_extra.weight": (q8_1, Q.Q8_1), "blk.1.attn_extra.weight": (iq4, Q.IQ4_NL)},
    )
    with pytest.raises(ValueError, match=r"unsupported GGUF tensor types \['IQ4_NL', 'Q8_1'\]") as info:
        GGUFCheckpoint(made.path)
    assert "supported:" in str(info.value) and "Q4_K" in str(info.value)


def test_missing_required_metadata(tmp_path: Path) -> None:
    path = write_metadata_only(tmp_path / "m.gguf", "llama", embedding_length=256, block_count=1)
    with pytest.raises(ValueError, match=r"m\.gguf: GGUF metadata lacks llama\.attention\.head_count"):
        GGUFCheckpoint(path).hf_config()


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 4)
    with pytest.raises(ValueError, match=r"junk\.gguf: not a readable GGUF file \(GGUF magic invalid\)"):
        GGUFCheckpoint(path)


def test_truncated_gguf_file(tmp_path: Path) -> None:
    whole = write_gguf(tmp_path / "whole.gguf", "llama", Q.F32).path
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"cut\.gguf: not a readable GGUF file"):
        GGUFCheckpoint(cut)


def _tokenizer_only(path: Path, pre: str, eos: str, **ids: int) -> Path:
    """A qwen2 GGUF with a ChatML-style vocabulary and no tensors: enough for the end tokens."""
    tokens = ["a", "b", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>"]
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1, 1, 3, 3, 3, 4])  # 3 CONTROL, 4 USER_DEFINED
    writer.add_eos_token_id(tokens.index(eos))
    for key, value in ids.items():
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_qwen_ends_at_im_end_and_endoftext(tmp_path: Path) -> None:
    """Qwen's HF generation_config stops on both; the GGUF names only <|im_end|> as eos."""
    checkpoint = GGUFCheckpoint(_tokenizer_only(tmp_path / "q.gguf", "qwen2", "<|im_end|>"))
    assert checkpoint.pre_tokenizer == "qwen2"
    assert checkpoint.end_of_generation_ids() == [2, 4]
    assert checkpoint.tokenizer_normalizer() == {"type": "NFC"}


def test_other_families_end_at_eos_eot_and_eom_only(tmp_path: Path) -> None:
    checkpoint = GGUFCheckpoint(_tokenizer_only(tmp_path / "l.gguf", "llama-bpe", "<|im_end|>", eot=1))
    assert checkpoint.end_of_generation_ids() == [1, 4]
    assert checkpoint.tokenizer_normalizer() is None
