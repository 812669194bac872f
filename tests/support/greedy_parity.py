"""Greedy runs of a tiny checkpoint against transformers, for the 4-bit checkpoints' tests
(tests/models/test_kimi_k25.py, tests/layers/test_int4_linear.py): the reference's choices
checked free of near-ties first, so an exact comparison with the engine is not luck."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem import LLM, SamplingParams

# One thread, small blocks and steps: several chunks and cache hits on prompts of tens of tokens.
TINY_ENGINE = dict(kv_cache_memory="8MiB", num_threads=1, block_size=4, max_num_batched_tokens=16)


def reference_greedy(reference: torch.nn.Module, prompts: list[list[int]], max_tokens: int,
                     min_gap: float) -> list[list[int]]:
    """transformers' greedy continuations of every prompt (no end of sequence), each step's
    top-two logit gap above `min_gap` (a tie the engine's rounding could flip fails here)."""
    reference.generation_config.eos_token_id = None  # as ignore_eos: every step greedy
    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            generated = reference.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                           output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        gaps = [float(step[0].topk(2).values.diff().abs()) for step in generated.logits]
        assert min(gaps) > min_gap, f"near-tie in the reference's greedy choices for {prompt}: {min(gaps)}"
        outputs.append(generated.sequences[0, len(prompt):].tolist())
        assert len(outputs[-1]) == max_tokens
    return outputs


def engine_greedy(directory: Path, prompts: list[list[int]], first: int, max_tokens: int,
                  min_cached: int, **mode: int) -> list[list[int]]:
    """The engine's greedy tokens for `prompts[:first]`, then for the rest (which repeat their
    prefixes: at least `min_cached` tokens must come from the cache), every block freed after."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with LLM(str(directory), **TINY_ENGINE, **mode) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(prompts[:first], greedy)]
        again = llm.generate(prompts[first:], greedy)
        assert sum(o.num_cached_tokens for o in again) >= min_cached  # the repeated prefixes hit the cache
        pool = llm.engine.block_pool
        assert pool.num_free_blocks == pool.num_blocks
    return before + [o.outputs[0].token_ids for o in again]
