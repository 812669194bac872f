"""The KV tiers on the default model: a prefix evicted from the device pool comes back from the
CPU tier with the same greedy tokens, counted as cached, and every pool returns to idle."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tandem import LLM
from tandem.config import KVTiersConfig
from tandem.types import SamplingParams

BLOCK_BYTES = 30 * 2 * 3 * 16 * 64 * 4  # SmolLM2-135M, fp32, 16-token blocks
GREEDY = SamplingParams(max_tokens=12, temperature=0)
SHARED = "The history of the old harbour town is long and full of stories about ships. " * 24
FILLERS = [f"Filler document {i}: " + f"an unrelated passage about topic {i} and more words. " * 30
           for i in range(3)]


def evict_shared_prefix(llm: LLM) -> None:
    """Fill the device pool with other prompts so the shared prefix's blocks are reused."""
    llm.generate(FILLERS, SamplingParams(max_tokens=1, temperature=0))


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert engine.block_pool.num_used_blocks == 0
    assert engine.scheduler.num_held_blocks == 0
    assert not engine.scheduler.connector._loads and not engine.scheduler.connector._inflight


@pytest.fixture(scope="module")
def cold_outputs() -> list[str]:
    with LLM(kv_cache_memory=512 * BLOCK_BYTES, max_num_batched_tokens=512) as llm:
        return [o.outputs[0].text for o in llm.generate([SHARED + "Question: who built it?"], GREEDY)]


@pytest.fixture(scope="module")
def cpu_llm() -> Iterator[LLM]:
    llm = LLM(kv_cache_memory=64 * BLOCK_BYTES, max_num_batched_tokens=512,
              kv_tiers=KVTiersConfig(cpu_bytes=256 << 20, chunk_blocks=4))
    yield llm
    llm.shutdown()


def test_prefix_comes_back_from_cpu(cpu_llm: LLM, cold_outputs: list[str]) -> None:
    prompt = SHARED + "Question: who built it?"
    first = cpu_llm.generate([prompt], GREEDY)[0]
    assert first.outputs[0].text == cold_outputs[0]
    evict_shared_prefix(cpu_llm)
    assert cpu_llm.engine.kv_manager.cached_prefix_blocks(_request(cpu_llm, prompt)) == 0
    loaded_before = cpu_llm.engine.scheduler.stats.num_loaded_tokens
    again = cpu_llm.generate([prompt], GREEDY)[0]
    assert again.outputs[0].text == cold_outputs[0]
    loaded = cpu_llm.engine.scheduler.stats.num_loaded_tokens - loaded_before
    assert loaded >= 16 * 4 * (len(again.prompt_token_ids) // 64 - 1)
    assert again.num_cached_tokens >= loaded
    tiers = cpu_llm.engine.core.load().kv_tiers
    assert tiers["loads"] >= 1 and tiers["media"]["cpu"]["chunk_hits"] >= 1
    assert tiers["load_seconds"]["cpu"]["count"] >= 1
    assert_idle(cpu_llm)


def _request(llm: LLM, prompt: str):
    from tandem.types import Request

    ids = llm.engine.tokenizer.encode(prompt)
    req = Request("probe", ids, GREEDY)
    llm.engine.kv_manager.update_block_hashes(req)
    return req
