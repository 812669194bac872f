"""Logit parity against transformers on tiny random configs of every supported architecture.

The sequences go through the paged path the engine uses: several sequences in one flat
batch, prefill split into chunks that attend to their own cached context, and decode steps
mixed with prefill chunks. Every logit row must match transformers' full-sequence forward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tandem.batch.prepared import ScheduledChunk, prepare_batch
from tandem.kernels.base import kv_cache_shape
from tandem.kernels.torch_attention import TorchAttentionBackend
from tandem.layers.linear import pack_weights_for_cpu
from tandem.layers.moe import FusedMoE, route
from tandem.loader.model_loader import build_model, load_weights, read_model_config
from tandem.types import Request, SamplingParams

BLOCK = 4
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=False),
    "llama-tied-bias-linear-rope": lambda: transformers.LlamaConfig(
        **SMALL, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}),
    "llama3-rope": lambda: transformers.LlamaConfig(
        **SMALL, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 32}),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=None),
    "qwen2-tied": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
    "qwen2-untied": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=True),
    # mixtures of experts: 8 experts, 2 per token; Qwen3-MoE with a dense first layer
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=8, num_experts_per_tok=2,
                                                  sliding_window=None),
    "qwen3-moe-dense-first": lambda: transformers.Qwen3MoeConfig(
        **SMALL, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_only_layers=[0], norm_topk_prob=True, tie_word_embeddings=False),
    "qwen3-moe-unnormalised": lambda: transformers.Qwen3MoeConfig(
        **SMALL, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=False, tie_word_embeddings=True),
    # DeepSeek-V3 / Kimi-K2: latent attention (low-rank queries, interleaved YaRN rotary), a
    # dense first layer, then 8 experts in 4 groups, 2 groups eligible, 2 experts, a shared one
    "deepseek-v3": lambda: transformers.DeepseekV3Config(
        **{**SMALL, "num_key_value_heads": 4}, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
        first_k_dense_replace=1, n_shared_experts=1, moe_intermediate_size=16, routed_scaling_factor=2.5,
        rope_interleave=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 32}),
}
CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "llama-tied-bias-linear-rope": transformers.LlamaForCausalLM,
    "llama3-rope": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "qwen2-tied": transformers.Qwen2ForCausalLM,
    "qwen2-untied": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "mixtral": transformers.MixtralForCausalLM,
    "qwen3-moe-dense-first": transformers.Qwen3MoeForCausalLM,
    "qwen3-moe-unnormalised": transformers.Qwen3MoeForCausalLM,
    "deepseek-v3": transformers.DeepseekV3ForCausalLM,
}


def _save_random_model(name: str, directory: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    config = CONFIGS[name]()
    model = CLASSES[name](config).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
        for bname, buffer in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # a buffer in transformers, a weight on disk
                buffer.copy_(0.5 * torch.randn_like(buffer))
    model.save_pretrained(directory)
    return model


class _PagedSequences:
    """Feeds known token sequences through the model in scheduled chunks (teacher forcing)."""

    def __init__(self, model: torch.nn.Module, sequences: list[list[int]]) -> None:
        cfg = model.config
        self.model = model
        self.requests = [Request(f"r{i}", seq, SamplingParams(max_tokens=1)) for i, seq in enumerate(sequences)]
        blocks_each = -(-max(len(s) for s in sequences) // BLOCK)
        self.block_ids = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(sequences))]
        spec = cfg.kv_spec  # K/V heads, or one latent plane for MLA
        shape = kv_cache_shape(blocks_each * len(sequences), BLOCK, spec.num_heads, spec.head_dim, spec.num_planes)
        self.kv_caches = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
        self.logits: list[dict[int, torch.Tensor]] = [{} for _ in sequences]

    def step(self, plan: dict[int, tuple[int, int]]) -> None:
        """plan: sequence index -> (start, num_tokens) computed this step."""
        chunks = []
        for index, (start, count) in plan.items():
            request = self.requests[index]
            chunks.append(ScheduledChunk(request.request_id, request.all_token_ids[start : start + count], start,
                                         self.block_ids[index], start + count == request.num_tokens))
        batch = prepare_batch(chunks, BLOCK)
        with torch.inference_mode():
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
            logits = self.model.compute_logits(hidden)
        # map flat rows back to (sequence, position)
        decodes = [c for c in chunks if c.num_tokens == 1 and c.start > 0]
        prefills = [c for c in chunks if not (c.num_tokens == 1 and c.start > 0)]
        row = 0
        for chunk in decodes + prefills:
            index = [r.request_id for r in self.requests].index(chunk.request_id)
            for offset in range(chunk.num_tokens):
                self.logits[index][chunk.start + offset] = logits[row]
                row += 1


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name: str, tmp_path: Path) -> None:
    reference = _save_random_model(name, tmp_path)
    config = read_model_config(tmp_path)
    model = build_model(config, TorchAttentionBackend(), 128, torch.float32)
    load_weights(model, tmp_path)
    pack_weights_for_cpu(model)  # as the engine runs it
    if config.moe is not None:  # the random router really spreads tokens over the experts
        layer = next(m for m in model.modules() if isinstance(m, FusedMoE))
        _, experts = route(model.model.embed_tokens.weight[:48] @ layer.gate.T, config.moe)
        assert experts.unique().numel() > config.moe.top_k

    for got, expected in mixed_schedule_logits(model, reference, 96):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def mixed_schedule_logits(model: torch.nn.Module, reference: torch.nn.Module,
                          vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(paged logits, transformers' logits) of three random sequences run through chunked
    prefill mixed with decodes: the same schedule for every parity test."""
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (23, 17, 9)]
    paged = _PagedSequences(model, sequences)
    # step 1: seq 0 and 1 start prefill in chunks, seq 2 whole prompt
    paged.step({0: (0, 10), 1: (0, 6), 2: (0, 8)})
    # step 2: seq 2 decodes one token, seq 0 continues prefill over its cached context, seq 1 too
    paged.step({2: (8, 1), 0: (10, 7), 1: (6, 5)})
    # steps 3+: a mix of decodes and chunks until every position is computed
    paged.step({0: (17, 1), 1: (11, 6)})
    for position in range(18, 23):
        paged.step({0: (position, 1)})
    pairs = []
    for index, tokens in enumerate(sequences):
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0]
        pairs.append((torch.stack([paged.logits[index][p] for p in range(len(tokens))]), expected))
    return pairs
