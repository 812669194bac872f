"""`tandem bench gpu` without a GPU: its arithmetic, its shipped config, and a clear refusal.
The measurement itself needs a GPU (see the README's GPU section for how it ran)."""

from __future__ import annotations

import json

import pytest

from tandem.bench.gpu import CONFIGS, config_path, weight_shape
from tandem.cli import main


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
