"""EAGLE-3 in the engine on the default model: the target keeps its aux hidden states, the
head catches up on them after each step and guesses; greedy output never changes.

The head here has random weights in the published HF layout, sized for SmolLM2-135M (the
trained one comes from `tandem spec train-eagle3` and is measured by `tandem bench spec`),
so most guesses fail and rollback runs on most steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tandem import LLM, SamplingParams

PROMPTS = ["Repeat exactly: the quick brown fox jumps over the lazy dog.", "List five fruits, one per line."]
PARAMS = SamplingParams(temperature=0, max_tokens=32)


def random_head(directory: Path, draft_vocab: int = 2048) -> Path:
    """A random EAGLE-3 head for SmolLM2-135M (hidden 576, 9 heads of 64, 3 KV heads, 30 layers)."""
    hidden, inter, heads, kv_heads, head_dim, vocab = 576, 1536, 9, 3, 64, 49152
    g = torch.Generator().manual_seed(0)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * 0.05

    weights = {
        "fc.weight": mat(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": mat(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": mat(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": mat(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": mat(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.mlp.gate_proj.weight": mat(inter, hidden),
        "midlayer.mlp.up_proj.weight": mat(inter, hidden),
        "midlayer.mlp.down_proj.weight": mat(hidden, inter),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": mat(draft_vocab, hidden),
        "d2t": torch.zeros(draft_vocab, dtype=torch.long),  # draft id i is target id i
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "target_hidden_size": hidden}))
    save_file(weights, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    with LLM(kv_cache_memory="128MiB") as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_a_random_eagle3_head_changes_nothing(plain: list[list[int]], tmp_path: Path) -> None:
    head = random_head(tmp_path / "head")
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "adaptive": False}
    with LLM(kv_cache_memory="128MiB", speculative_config=spec) as llm:
        outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        stats = llm.engine.core.speculator.stats
        runner = llm.engine.core.executor.worker.runner
        assert runner.model.aux_hidden_layers == (2, 15, 27)
        assert runner.drafter.report.catch_up_tokens > 0
        pool = llm.engine.block_pool
        assert pool.num_free_blocks == pool.num_blocks
    assert outputs == plain
    assert stats.num_drafts > 20


def test_a_head_for_another_target_is_refused(tmp_path: Path) -> None:
    head = random_head(tmp_path / "head")
    config = json.loads((head / "config.json").read_text())
    config["target_hidden_size"] = 896
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="was made for a target"):
        LLM(kv_cache_memory="64MiB", speculative_config={"method": "eagle3", "model": str(head),
                                                          "num_speculative_tokens": 2})
