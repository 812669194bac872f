"""`tandem plan memory` on the command line: the table, JSON, one-line errors, help, no torch,
and the shipped example configs found from any directory (they are package data)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TANDEM = [sys.executable, "-m", "tandem.cli.main"]

# meta-llama/Llama-3.1-8B's dimensions (the published config.json's shape fields).
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TANDEM, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_cli_prints_the_table() -> None:
    result = run("plan", "memory", "llama-4-scout", "--devices", "2xH200", "--tp", "2")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for row in ("weights", "activation peak", "reserved (CUDA, NCCL)", "KV cache left",
                "KV bytes per token", "KV tokens that fit", "seqs of 10,485,760 tokens"):
        assert f"\n{row} " in out, row
    assert "tandem" in out and "vLLM defaults" in out and "96.0 KiB" in out
    assert "vLLM, its defaults (gpu_memory_utilization 0.9 of everything, 8192 tokens, 1024 seqs)" in out


def test_cli_json_and_a_config_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    result = run("plan", "memory", str(tmp_path), "--devices", "2xH100", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["parallel"] == {"tp": 2, "pp": 1, "ep": False}  # tp defaults to the devices
    assert data["tandem"]["kv_tokens"] == data["tandem"]["stages"][0]["kv_tokens"] > 0
    assert data["vllm"]["memory_utilization"] == 0.9


@pytest.mark.parametrize(("args", "message"), [
    (("memory", "{gpt2}"), "not supported by the memory plan; supported:"),
    (("memory", "llama-3.1-70b", "--devices", "3xH100"), "tp 3 does not divide the 64 attention heads"),
    (("memory", "kimi-k2", "--devices", "8xH100"), "the weights do not fit on 8 x H100"),
    (("memory", "no-such-model"), "no config.json at 'no-such-model'"),
    (("memory", "llama-3.1-70b", "--devices", "2xB300"), "unknown device"),
])
def test_cli_errors_are_one_line_and_nonzero(tmp_path: Path, args: tuple, message: str) -> None:
    gpt2 = tmp_path / "config.json"
    gpt2.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    result = run("plan", *(str(gpt2) if a == "{gpt2}" else a for a in args))
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.startswith("tandem: error: ")


def test_cli_help() -> None:
    result = run("plan", "--help")
    assert result.returncode == 0 and "memory" in result.stdout
    result = run("plan", "memory", "--help")
    assert result.returncode == 0
    assert "kimi-k2" in result.stdout and "--memory-utilization" in result.stdout


def test_plan_imports_no_torch() -> None:
    """The whole command, through tandem.cli.main, runs without importing torch."""
    script = textwrap.dedent("""
        import contextlib, io, sys
        from tandem.cli.main import main
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["plan", "memory", "kimi-k2", "--devices", "8xH200"]) == 0
        print(sorted(m for m in ("torch", "transformers", "tandem.engine") if m in sys.modules))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_examples_are_found_from_any_directory(tmp_path: Path) -> None:
    """The example configs ship inside the package: no repository checkout around the cwd."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([*TANDEM, "plan", "memory", "kimi-k2", "--devices", "8xH200"], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("kimi-k2 (DeepseekV3ForCausalLM)")


def test_a_transformers_v5_qwen3_moe_config_plans(tmp_path: Path) -> None:
    """transformers v5 writes Qwen3-MoE's expert count as num_local_experts, as the engine reads it."""
    from tandem.sizing.examples import load_config

    _, config = load_config("qwen3-235b-a22b")
    config["num_local_experts"] = config.pop("num_experts")
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = run("plan", "memory", str(tmp_path), "--devices", "8xH200", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["architecture"] == "Qwen3MoeForCausalLM" and data["tandem"]["kv_tokens"] > 0
