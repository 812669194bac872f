"""`tandem bench gpu` without a GPU: its arithmetic, its shipped config, and a clear refusal.
The measurement itself needs a GPU (see the README's GPU section for how it ran)."""

from __future__ import annotations

import json

import pytest

from tandem.bench.gpu import CONFIGS, config_path, weight_shape
from tandem.cli.main import main


def test_llama_8b_config_has_8b_parameters() -> None:
    shape = weight_shape(json.loads(config_path("llama-3.1-8b").read_text()))
    assert shape["params"] == 8_030_261_248 - 2 * 32 * 4096 - 4096  # HF's count, less the norms
    assert shape["matmul_params"] == shape["params"] - 128256 * 4096
    assert (shape["layers"], shape["heads"], shape["kv_heads"], shape["head_dim"]) == (32, 32, 8, 128)


def test_config_names_and_files(tmp_path) -> None:
    assert config_path("llama-3.1-8b") == CONFIGS / "llama-3.1-8b.json"
    own = tmp_path / "config.json"
    own.write_text("{}")
    assert config_path(str(own)) == own
    with pytest.raises(ValueError, match="llama-3.1-8b"):
        config_path("no-such-model")


def test_refuses_without_a_gpu(capsys) -> None:
    assert main(["bench", "gpu", "--no-transformers"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_kv_room_beside_vllm_and_a_contiguous_cache(tmp_path, capsys) -> None:
    """The bench's KV line on a small dummy model here (the GPU's total passed in)."""
    from tandem.bench.gpu import kv_room
    from tandem.llm import LLM

    config = json.loads(config_path("llama-3.1-8b").read_text())
    config.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=1024)
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), load_format="dummy", kv_cache_memory="8MiB", max_model_len=512)
    try:
        kv_per_token = 2 * 4 * 2 * 2 * 64  # K and V, fp32, 2 layers, 2 heads, 64 dims
        room = kv_room(llm, config, 512, kv_per_token, 256, 80 << 30)
    finally:
        llm.shutdown()
    assert room["tandem_tokens"] == 8 * 2**20 // (kv_per_token * 16) * 16
    assert room["paged_sequences"] == room["tandem_tokens"] // 256
    assert room["contiguous_sequences"] == room["tandem_tokens"] // 512
    assert room["vllm_default_tokens"] > 0
    assert "vLLM's defaults here (planned)" in capsys.readouterr().out


def test_an_unknown_config_fails_at_parse_time(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "gpu", "--config", "no-such-model"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("tandem: error: --config no-such-model: no such file")
