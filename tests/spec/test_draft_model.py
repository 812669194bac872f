"""The draft-model proposer on the default model: output unchanged, KV kept in step.

Two drafts bracket the acceptance rate: the target drafting for itself (nearly every guess
holds, so a draft whose KV drifted from the target's tokens would show as lost acceptance)
and a tiny random model with the same tokenizer (nearly every guess fails, so rollback runs
on most steps). Both must leave greedy output exactly as without speculation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from tandem import LLM, SamplingParams
from tandem.loader.resolve import resolve_model

PROMPTS = [
    "Here is a function:\n```python\ndef area(width, height):\n    return width * height\n```\nRepeat it exactly.",
    "Write two sentences about the sea.",
    "List five fruits, one per line.",
]
PARAMS = [SamplingParams(temperature=0, max_tokens=40), SamplingParams(temperature=0, max_tokens=24),
          SamplingParams(temperature=0, max_tokens=32, logprobs=1)]
PENALISED = SamplingParams(temperature=0, max_tokens=32, repetition_penalty=1.3)


def chat(llm: LLM) -> list[list[int]]:
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def draft(method_model: str, k: int = 4, adaptive: bool = False, weights: str = "int4") -> dict:
    return {"method": "draft_model", "model": method_model, "num_speculative_tokens": k, "adaptive": adaptive,
            "draft_decode_weights": weights}


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    with LLM(kv_cache_memory="128MiB") as llm:
        return chat(llm)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer random model speaking the default model's tokenizer."""
    directory = tmp_path_factory.mktemp("random-draft")
    source = resolve_model("smollm2-135m").hf_dir
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048))
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, directory / name)
    return directory


def test_the_target_drafting_for_itself_is_accepted_and_changes_nothing(plain: list[list[int]]) -> None:
    with LLM(kv_cache_memory="128MiB", speculative_config=draft("smollm2-135m")) as llm:
        assert chat(llm) == plain
        stats = llm.engine.core.speculator.stats
        pool = llm.engine.block_pool
        assert pool.num_free_blocks == pool.num_blocks
    assert stats.num_draft_tokens > 40
    assert stats.acceptance_rate > 0.9  # a draft reading stale or misplaced KV would miss far more


def test_a_draft_keeps_its_own_cache_beside_an_int8_target_s() -> None:
    """The target's cache is int8 rows; the draft's is in its model's dtype, so the draft runs
    as it would beside a float target and the tokens are the int8 target's own."""
    with LLM(kv_cache_memory="128MiB", kv_cache_dtype="int8") as llm:
        want = chat(llm)
    with LLM(kv_cache_memory="128MiB", kv_cache_dtype="int8", speculative_config=draft("smollm2-135m")) as llm:
        assert chat(llm) == want
        stats = llm.engine.core.speculator.stats
    assert stats.num_draft_tokens > 40 and stats.acceptance_rate > 0.8


@pytest.mark.parametrize("weights, least", [("none", 0.97), ("int4", 0.6)])
def test_a_decode_catches_up_only_on_what_its_guesses_did_not_write(plain: list[list[int]], weights: str,
                                                                     least: float) -> None:
    """The KV of accepted guesses is kept: after the prompt, a step's catch-up is the sampled
    token (and the last guess when all were kept), not every kept token again. Kept KV that
    was wrong would show as lost acceptance of the target drafting for itself."""
    with LLM(kv_cache_memory="128MiB", speculative_config=draft("smollm2-135m", weights=weights)) as llm:
        report = llm.engine.core.executor.worker.runner.drafter.report
        outputs = llm.chat([[{"role": "user", "content": PROMPTS[0]}]], PARAMS[0], use_tqdm=False)
        stats = llm.engine.core.speculator.stats
    assert outputs[0].outputs[0].token_ids == plain[0]
    generated = len(plain[0])
    decode_catch_up = report.catch_up_tokens - len(outputs[0].prompt_token_ids)
    # All guesses kept at k = 4: 5 tokens per step, 2 caught up (every one of them before).
    assert decode_catch_up <= 0.6 * generated
    assert stats.acceptance_rate >= least


def test_a_prefix_cache_hit_reuses_the_drafts_kv_and_a_connector_load_does_not(plain: list[list[int]]) -> None:
    long_prompt = PROMPTS[0] * 4
    params = SamplingParams(temperature=0, max_tokens=8)
    with LLM(kv_cache_memory="128MiB", speculative_config=draft("smollm2-135m")) as llm:
        runner = llm.engine.core.executor.worker.runner
        report = runner.drafter.report
        first = llm.generate([long_prompt], params, use_tqdm=False)[0]
        cold = report.catch_up_tokens
        second = llm.generate([long_prompt], params, use_tqdm=False)[0]
        warm = report.catch_up_tokens - cold
        assert second.num_cached_tokens >= 64
        assert second.outputs[0].token_ids == first.outputs[0].token_ids
        # Only the uncached tail and the new tokens: the cached blocks' draft KV was good.
        assert warm <= len(first.prompt_token_ids) - second.num_cached_tokens + 16
        assert cold >= len(first.prompt_token_ids)
        # A connector writing the cached blocks (as a PD handoff does) makes the draft rebuild them.
        blocks = llm.engine.block_pool
        cached = [b.block_id for b in blocks.blocks if b.block_hash is not None]
        runner.write_blocks(cached, runner.read_blocks(cached))
        llm.generate([long_prompt], params, use_tqdm=False)
        assert report.catch_up_tokens - cold - warm >= second.num_cached_tokens


def test_a_random_draft_is_rejected_and_changes_nothing(plain: list[list[int]], random_draft: Path) -> None:
    with LLM(kv_cache_memory="128MiB", speculative_config=draft(str(random_draft), k=3)) as llm:
        assert chat(llm) == plain
        stats = llm.engine.core.speculator.stats
    with LLM(kv_cache_memory="128MiB") as llm:
        penalised = llm.generate(PROMPTS[:1], PENALISED, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(kv_cache_memory="128MiB", speculative_config=draft("smollm2-135m")) as llm:
        # The draft guesses without the penalty; the target's rows apply it per position.
        assert llm.generate(PROMPTS[:1], PENALISED, use_tqdm=False)[0].outputs[0].token_ids == penalised
    assert stats.num_drafts > 20
    assert stats.acceptance_rate < 0.3


def test_adaptive_k_with_a_draft_model_changes_nothing(plain: list[list[int]]) -> None:
    with LLM(kv_cache_memory="128MiB", speculative_config=draft("smollm2-135m", adaptive=True)) as llm:
        assert chat(llm) == plain
        assert llm.engine.core.speculator.stats.num_accepted_tokens > 0


def test_a_draft_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    source = resolve_model("smollm2-135m").hf_dir
    other = tmp_path / "other-vocab"
    other.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(source / name, other / name)
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two tokens swap ids
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="does not share the target's vocabulary"):
        LLM(kv_cache_memory="64MiB", speculative_config=draft(str(other)))


def test_a_draft_needs_a_model_and_one_rank() -> None:
    with pytest.raises(ValueError, match="needs a \"model\""):
        LLM(speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="draft_model"):
        LLM(load_format="dummy", tensor_parallel_size=2, speculative_config=draft("smollm2-135m"))
