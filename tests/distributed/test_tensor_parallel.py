"""Tensor parallelism on gloo: two ranks, each holding half of every layer, give transformers'
logits (column- and row-parallel linears, vocabulary-split embedding and head, heads split)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.distributed.tensor_parallel import TensorParallel
from tandem.kernels.torch_attention import TorchAttentionBackend
from tandem.loader.model_loader import build_model, read_model_config
from tandem.platform.ports import free_port
from tests.support.tiny_models import CONFIGS, save_tiny


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_ranks_give_transformers_logits(name: str, tmp_path: Path) -> None:
    reference = save_tiny(name, tmp_path)
    tokens = torch.randint(0, 96, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    port = free_port()
    script = Path(__file__).with_name("tp_rank.py")
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(rank), "2", str(port), str(tmp_path),
                          str(tmp_path / f"logits{rank}.pt"), ",".join(map(str, tokens))],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]
    for process in ranks:
        output, _ = process.communicate(timeout=120)
        assert process.returncode == 0, output
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    whole = sum(p.numel() for name, p in reference.named_parameters() if "norm" not in name)
    for rank in range(2):
        got = torch.load(tmp_path / f"logits{rank}.pt")
        torch.testing.assert_close(got["logits"], expected, rtol=1e-4, atol=1e-4)
        assert got["held"] <= 0.55 * whole  # each rank really holds half the weights (+ padding)


def test_sizes_that_cannot_split_the_model_are_refused(tmp_path: Path) -> None:
    save_tiny("llama", tmp_path)  # 2 KV heads, intermediate 96
    config = read_model_config(tmp_path)
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 exceeds the model's 2 KV heads"):
        build_model(config, TorchAttentionBackend(), 128, torch.float32, TensorParallel(0, 3))
    odd_mlp = dataclasses.replace(config, num_key_value_heads=4, intermediate_size=97)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 does not divide the model's projection width"):
        build_model(odd_mlp, TorchAttentionBackend(), 128, torch.float32, TensorParallel(0, 2))


@pytest.mark.parametrize("size", [2, 3])
def test_the_default_model_split_over_ranks_gives_one_rank_s_tokens(size: int) -> None:
    """Engine level: `LLM(tensor_parallel_size=N)` runs N rank processes on gloo, each with its
    share of every layer. SmolLM2 has 9 query and 3 KV heads: 2 ranks hold 2 + 1 KV groups, 3
    ranks one each; blocks are sized for the rank with the most heads."""
    from tandem import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "Q: What is 7 times 8?\nA:"]
    greedy = SamplingParams(max_tokens=16, temperature=0)
    with LLM(kv_cache_memory="64MiB", num_threads=1, block_size=16) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, greedy)]
        blocks_one = one.engine.block_pool.num_blocks
    with LLM(kv_cache_memory="64MiB", num_threads=1, block_size=16, tensor_parallel_size=size) as split:
        assert [o.outputs[0].token_ids for o in split.generate(prompts, greedy)] == expected
        largest_share = -(-3 // size)  # KV heads on rank 0
        assert split.engine.block_pool.num_blocks == blocks_one * 3 // largest_share
        pool = split.engine.block_pool
        assert pool.num_free_blocks == pool.num_blocks
