"""Tensor parallelism on gloo: two ranks, each holding half of every layer, give transformers'
logits (column- and row-parallel linears, vocabulary-split embedding and head, heads split)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tandem.distributed.tensor_parallel import TensorParallel
from tandem.kernels.torch_attention import TorchAttentionBackend
from tandem.loader.model_loader import build_model, read_model_config

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
CONFIGS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, vocab_size=96, tie_word_embeddings=False, attention_bias=True)),
    # an odd vocabulary: the last rank's share of the embedding and head is padded
    "qwen2-tied-odd-vocab": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, vocab_size=97, tie_word_embeddings=True)),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _save(name: str, directory: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = CONFIGS[name]().eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in pname else 0.08 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_ranks_give_transformers_logits(name: str, tmp_path: Path) -> None:
    reference = _save(name, tmp_path)
    tokens = torch.randint(0, 96, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    port = _free_port()
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


def test_a_size_that_does_not_divide_the_heads_is_refused(tmp_path: Path) -> None:
    _save("llama", tmp_path)
    config = read_model_config(tmp_path)
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 does not divide the model's attention heads"):
        build_model(config, TorchAttentionBackend(), 128, torch.float32, TensorParallel(0, 3))


def test_the_default_model_split_over_three_ranks_gives_one_rank_s_tokens() -> None:
    """Engine level: `LLM(tensor_parallel_size=3)` runs three rank processes on gloo, each with
    a third of every layer and one of SmolLM2's 3 KV heads, so the same KV budget holds three
    times the blocks."""
    from tandem import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "Q: What is 7 times 8?\nA:"]
    greedy = SamplingParams(max_tokens=16, temperature=0)
    with LLM(kv_cache_memory="64MiB", num_threads=1) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, greedy)]
        blocks_one = one.engine.block_pool.num_blocks
    with LLM(kv_cache_memory="64MiB", num_threads=1, tensor_parallel_size=3) as three:
        assert [o.outputs[0].token_ids for o in three.generate(prompts, greedy)] == expected
        assert three.engine.block_pool.num_blocks == 3 * blocks_one
        pool = three.engine.block_pool
        assert pool.num_free_blocks == pool.num_blocks


def test_tensor_parallel_refuses_what_it_cannot_do_yet() -> None:
    from tandem.config import ParallelConfig

    with pytest.raises(ValueError, match="the tensor-parallel group must be every rank"):
        ParallelConfig.of(world_size=4, tensor_parallel_size=2)
    assert ParallelConfig.of(tensor_parallel_size=2).world_size == 2
