"""Tensor parallelism on gloo: two ranks, each holding half of every layer, give transformers'
logits (column- and row-parallel linears, vocabulary-split embedding and head, heads split)."""

from __future__ import annotations

import dataclasses
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
    # experts split by their intermediate size, one all-reduce after the combine
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, vocab_size=96, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    # latent attention split by head (the latent whole on each rank), grouped experts, a shared one
    "deepseek-v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**SMALL, "num_key_value_heads": 4}, vocab_size=96, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1, moe_intermediate_size=16)),
    # 3 KV heads (2 query heads each) over 2 ranks: dealt 2 + 1 by KV group, as SmolLM2's are
    "llama-3-kv-heads": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**SMALL, "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3}, vocab_size=96)),
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


def test_sizes_that_cannot_split_the_model_are_refused(tmp_path: Path) -> None:
    _save("llama", tmp_path)  # 2 KV heads, intermediate 96
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
    with LLM(kv_cache_memory="64MiB", num_threads=1) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, greedy)]
        blocks_one = one.engine.block_pool.num_blocks
    with LLM(kv_cache_memory="64MiB", num_threads=1, tensor_parallel_size=size) as split:
        assert [o.outputs[0].token_ids for o in split.generate(prompts, greedy)] == expected
        largest_share = -(-3 // size)  # KV heads on rank 0
        assert split.engine.block_pool.num_blocks == blocks_one * 3 // largest_share
        pool = split.engine.block_pool
        assert pool.num_free_blocks == pool.num_blocks


def test_tensor_parallel_refuses_what_it_cannot_do_yet() -> None:
    from tandem.config import ParallelConfig

    with pytest.raises(ValueError, match="the tensor-parallel group must be every rank"):
        ParallelConfig.of(world_size=4, tensor_parallel_size=2)
    assert ParallelConfig.of(tensor_parallel_size=2).world_size == 2
