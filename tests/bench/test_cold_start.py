"""`tandem bench cold-start`: cold and warm loads of a small checkpoint against dd of its files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def _bench(model_dir: Path, out: Path, *args: str) -> tuple[str, dict]:
    done = subprocess.run([sys.executable, "-m", "tandem", "bench", "cold-start", str(model_dir), "--repeats", "2", "--warmup", "0",
                           "--output-dir", str(out), *args], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = out.glob("load-*")
    return done.stdout, json.loads((run_dir / "results.json").read_text())


def test_cold_and_warm_loads_are_timed_beside_dd(model_dir: Path, tmp_path: Path) -> None:
    stdout, data = _bench(model_dir, tmp_path)
    rows = {m.group(1): [float(x) for x in m.groups()[1:]] for m in re.finditer(
        r"^(dd bs=16M, best of 2|load, cold cache|load, warm cache)\s+([\d.]+)\s+([\d.]+)\s+(\d+)%\s+([\d.]+)$",
        stdout, re.M)}
    assert set(rows) == {"dd bs=16M, best of 2", "load, cold cache", "load, warm cache"}, stdout
    for seconds, gbps, _ratio, best in rows.values():
        assert 0 < best <= seconds and gbps > 0
    summary = data["summary"]
    assert len(summary["cold"]["all_seconds"]) == 2 and len(summary["dd"]["all_seconds"]) == 2
    assert abs(summary["cold"]["ratio_to_dd"] * 100 - rows["load, cold cache"][2]) <= 0.5
    assert re.search(r"^goal: cold load >= 80% of dd's GB/s: \d+% \(median of \d+%, \d+%\), (met|not met)$", stdout, re.M)
    assert summary["cache_drop"] in ("ok", "unverified") or summary["cache_drop"].startswith("failed")
    if summary["cache_drop"] == "ok":  # the cold load really read the file from disk
        (rank,) = summary["cold"]["ranks"]
        assert rank["read_bytes"] is None or rank["read_bytes"] >= 0.9 * data["bytes"]


def test_two_ranks_each_read_their_share(model_dir: Path, tmp_path: Path) -> None:
    stdout, data = _bench(model_dir, tmp_path, "--tensor-parallel-size", "2", "--no-warm")
    assert "load, warm cache" not in stdout
    ranks = data["summary"]["cold"]["ranks"]
    assert len(ranks) == 2 and re.search(r"^  rank 1: build [\d.]+ s \+ weights [\d.]+ s", stdout, re.M)
    for rank in ranks:
        assert rank["held_bytes"] < 0.6 * data["bytes"]  # each holds about half
    if data["summary"]["cache_drop"] == "ok":
        assert data["summary"]["cold"]["cached_after"] >= 0.9 * data["bytes"]  # together: all of it
        assert "the ranks together read" in stdout


def test_a_random_checkpoint_loads_into_the_engine(tmp_path) -> None:
    """`write_random_checkpoint` (the GPU cold start's model): transformers' names and shapes
    in shards, which tandem's loader fills its model from completely."""
    import json

    import torch

    from tandem.bench.cold_start import write_random_checkpoint
    from tandem.kernels.torch_attention import TorchAttentionBackend
    from tandem.loader.model_loader import build_model, load_weights, read_model_config

    config = tmp_path / "source.json"
    config.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 512, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}))
    paths = write_random_checkpoint(config, tmp_path / "model", shard_bytes=200_000)
    assert len(paths) > 1 and all(p.name.endswith(f"-of-{len(paths):05d}.safetensors") for p in paths)
    hf_dir = tmp_path / "model"
    model = build_model(read_model_config(hf_dir), TorchAttentionBackend(), 64, torch.bfloat16)
    load_weights(model, hf_dir)  # raises if any weight is missing
    assert model.model.layers[1].mlp.down_proj.weight.float().std().item() == pytest.approx(0.02, rel=0.1)


@pytest.mark.parametrize("flags", [["--repeats", "0"], ["--tensor-parallel-size", "0"],
                                   ["--warmup", "-1"]])
def test_counts_below_their_floor_fail_at_parse_time(flags: list[str], tmp_path: Path, capsys) -> None:
    from tandem.cli.main import main

    with pytest.raises(SystemExit) as exited:
        # "load", the old name, kept as an alias
        main(["bench", "load", *flags, "--output-dir", str(tmp_path / "out")])
    assert exited.value.code == 2
    assert capsys.readouterr().err == ("tandem: error: --repeats and --tensor-parallel-size must be "
                                       "at least 1, --warmup at least 0\n")
    assert not (tmp_path / "out").exists()
