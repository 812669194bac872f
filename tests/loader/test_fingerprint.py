"""Model fingerprints: the same weights give the same one, any other file or revision another."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tandem.kvcache.block_hash import root_hash
from tandem.loader.fingerprint import HEAD_BYTES, model_fingerprint, weights_digest
from tandem.loader.resolve import _smollm2_gguf, resolve_model


def _fake_checkpoint(directory: Path, payload: bytes) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (directory / "model.safetensors").write_bytes(payload)
    return directory


def test_same_weights_same_fingerprint_any_change_another(tmp_path: Path) -> None:
    big = bytes(range(256)) * ((HEAD_BYTES + (2 << 20)) // 256)  # longer than head + tail
    a = _fake_checkpoint(tmp_path / "a", big)
    b = _fake_checkpoint(tmp_path / "b", big)  # a copy elsewhere: the same model
    assert weights_digest(a) == weights_digest(b)
    tail_changed = bytearray(big)
    tail_changed[-10] ^= 1  # the last tensors of a new revision
    head_changed = bytearray(big)
    head_changed[100] ^= 1  # a header / first tensor
    config_changed = _fake_checkpoint(tmp_path / "c", big)
    (config_changed / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "x": 1}))
    digests = {weights_digest(a), weights_digest(_fake_checkpoint(tmp_path / "t", bytes(tail_changed))),
               weights_digest(_fake_checkpoint(tmp_path / "h", bytes(head_changed))),
               weights_digest(config_changed)}
    assert len(digests) == 4


def test_fingerprint_names_architecture_dtype_and_weights(tmp_path: Path) -> None:
    a = _fake_checkpoint(tmp_path / "a", b"weights")
    fp32 = model_fingerprint("LlamaForCausalLM", "float32", a)
    assert fp32.startswith("LlamaForCausalLM/float32/")
    assert model_fingerprint("LlamaForCausalLM", "bfloat16", a) != fp32
    assert model_fingerprint("Qwen2ForCausalLM", "float32", a) != fp32
    dummy = {model_fingerprint("LlamaForCausalLM", "float32", a, "dummy", seed) for seed in (0, 0, 1)}
    assert len(dummy) == 2 and fp32 not in dummy
    assert root_hash(fp32, "float32", 16) != root_hash(model_fingerprint("LlamaForCausalLM", "bfloat16", a),
                                                      "float32", 16)


def test_default_model_fingerprint_is_stable_and_follows_the_gguf(tmp_path: Path) -> None:
    gguf = _smollm2_gguf()
    resolved = resolve_model("smollm2-135m", "float32", None)
    assert resolved.source == gguf
    first = model_fingerprint("LlamaForCausalLM", "float32", resolved.source)
    assert first == model_fingerprint("LlamaForCausalLM", "float32", gguf)
    copy = tmp_path / gguf.name
    shutil.copyfile(gguf, copy)
    assert model_fingerprint("LlamaForCausalLM", "float32", copy) == first  # content, not path
    with copy.open("r+b") as handle:  # a revision: other bytes at the end
        handle.seek(-4, 2)
        handle.write(b"\x00\x01\x02\x03")
    assert model_fingerprint("LlamaForCausalLM", "float32", copy) != first
