"""`tandem plan memory kimi-k2.5` as it ships (INT4 experts, 262,144 positions) on 8 x H100 and
8 x H200: tensor parallel, expert parallel, an fp8 KV cache. The key figures, not the whole text.

Weights per rank at tp 8: the 553.40 GiB text model less its 2.05 GiB of replicated tensors
(MLA's q_a/kv_a down-projections, norms, the router) over 8, plus those (tests/sizing/test_kimi_k25.py
checks the bytes against the checkpoint's tensor table); vLLM's column adds the 0.88 GiB
vision tower and projector. KV: MLA's 576-value latent x 61 layers on every rank, 70,272 bytes
a token in bf16 (68.6 KiB), half in fp8.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def plan(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "tandem.cli.main", "plan", "memory", "kimi-k2.5", *args],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    return result.stdout


def row(out: str, name: str) -> list[str]:
    """The tandem and vLLM cells of a table row."""
    line = next(line for line in out.splitlines() if line.startswith(name + "  "))
    return re.split(r"\s{2,}", line[len(name):].strip())


def test_8xh100_tp8_fits_tandem_but_not_vllms_defaults() -> None:
    out = plan("--devices", "8xH100", "--tp", "8")
    assert out.startswith("kimi-k2.5 (KimiK25ForConditionalGeneration)")
    assert "weights     compressed-tensors pack-quantized int4 (symmetric, groups of 32) for routed experts; " \
           "rest bfloat16" in out
    assert "(+0.47B vision tower)" in out and "max-model-len 262,144" in out
    assert row(out, "weights") == ["70.95 GiB", "71.83 GiB"]
    assert row(out, "  of which vision tower") == ["-", "0.88 GiB"]
    assert row(out, "KV bytes per token") == ["68.6 KiB", "68.6 KiB"]
    assert row(out, "KV tokens that fit") == ["27,952", "0"]
    assert row(out, "seqs of 32,768 tokens") == ["0", "0"]
    assert row(out, "seqs of 262,144 tokens") == ["0", "0"]
    assert "vLLM with gpu_memory_utilization 0.9: the weights and its 8192-token activation peak leave no " \
           "room for a KV cache" in out
    assert "MLA caches one 576-value latent per token and layer, whole on every tp rank" in out
    assert "pass --max-model-len 27952 or less" in out


def test_8xh100_expert_parallel() -> None:
    out = plan("--devices", "8xH100", "--tp", "8", "--ep")
    assert "tp 8, pp 1, experts over 8 ranks (EP)" in out
    assert row(out, "weights") == ["70.95 GiB", "71.83 GiB"]  # 48 whole experts a rank: the same bytes
    assert row(out, "KV tokens that fit") == ["27,968", "0"]
    # vLLM's spelling is the same switch
    assert plan("--devices", "8xH100", "--tp", "8", "--enable-expert-parallel") == out


def test_8xh100_fp8_kv_cache_doubles_the_tokens() -> None:
    out = plan("--devices", "8xH100", "--tp", "8", "--kv-cache-dtype", "fp8")
    assert row(out, "KV bytes per token") == ["34.3 KiB", "34.3 KiB"]
    assert row(out, "KV tokens that fit") == ["55,920", "0"]
    assert row(out, "seqs of 32,768 tokens") == ["1", "0"]


def test_8xh200_holds_three_256k_sequences() -> None:
    out = plan("--devices", "8xH200", "--tp", "8")
    assert row(out, "weights") == ["70.95 GiB", "71.83 GiB"]
    assert row(out, "KV cache left") == ["57.67 GiB", "50.91 GiB"]
    assert row(out, "KV tokens that fit") == ["881,248", "777,952"]
    assert row(out, "seqs of 32,768 tokens") == ["26", "23"]
    assert row(out, "seqs of 131,072 tokens") == ["6", "5"]
    assert row(out, "seqs of 262,144 tokens") == ["3", "2"]
    fp8 = plan("--devices", "8xH200", "--tp", "8", "--kv-cache-dtype", "fp8", "--ep")
    assert row(fp8, "KV tokens that fit") == ["1,762,496", "1,535,872"]
    assert row(fp8, "seqs of 262,144 tokens") == ["6", "5"]


@pytest.mark.parametrize("length", ["262144", "131072"])
def test_the_max_model_len_is_taken_up_to_256k(length: str) -> None:
    data = json.loads(plan("--devices", "8xH200", "--tp", "8", "--max-model-len", length, "--json"))
    assert data["max_model_len"] == int(length)
    assert data["tandem"]["max_sequences_at_max_model_len"] == 881_248 // int(length)
    assert data["vllm"]["max_sequences"]["32768"] == 777_952 // 32768
    assert data["vllm"]["stages"][0]["vision_bytes"] == 942_287_840
