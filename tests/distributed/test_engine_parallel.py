"""Split engines give one rank's tokens: tensor, pipeline and expert parallelism on gloo,
through the whole engine (scheduler, executor, rank processes, paged KV, sampling), on tiny
random models of the new architectures: MoE with ordinary attention (Mixtral) and latent
attention with grouped experts (DeepSeek-V3 / Kimi-K2), plus a dense Llama.

The prompts exercise chunked prefill (a 16-token budget splits the long ones, and under
pipeline parallelism the chunks stream through the stages), prefix hits (a second round
repeats the first prompts' prefixes) and batched decode.
"""

from __future__ import annotations

import random
from pathlib import Path

import psutil
import pytest

from tandem import LLM, SamplingParams
from tandem.engine.memory_report import memory_split_lines
from tests.support.tiny_models import save_tiny

MODES = {
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2),
    "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
}
ENGINE = dict(kv_cache_memory="8MiB", num_threads=1, block_size=4, max_num_batched_tokens=16)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 96) for _ in range(length)] for length in (5, 23, 40, 9, 17, 31)]


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    # The same prefixes again with new endings: prefix-cache hits on split KV caches.
    again = [p[: len(p) // 2] + [7, 8, 9] for p in prompts]
    second = [o.outputs[0].token_ids for o in llm.generate(again, greedy)]
    return first + second


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    paths = {}
    for name in ("llama", "mixtral", "deepseek-v3"):
        paths[name] = tmp_path_factory.mktemp(name)
        save_tiny(name, paths[name], with_tokenizer=True)
    return paths


@pytest.fixture(scope="module")
def one_rank(models: dict[str, Path]) -> dict[str, list[list[int]]]:
    expected = {}
    for name, path in models.items():
        with LLM(str(path), **ENGINE) as llm:
            expected[name] = _run(llm, _prompts())
    return expected


# Expert parallelism only on the models that have experts.
CASES = [(name, mode) for name in ("llama", "mixtral", "deepseek-v3") for mode in MODES
         if not (mode == "ep2" and name == "llama")]


@pytest.mark.parametrize("name, mode", CASES)
def test_a_split_engine_gives_one_rank_s_tokens(name: str, mode: str, models: dict[str, Path],
                                                one_rank: dict[str, list[list[int]]]) -> None:
    with LLM(str(models[name]), **ENGINE, **MODES[mode]) as llm:
        ranks = [psutil.Process(p.pid) for p in llm.engine.core.executor._procs]
        assert _run(llm, _prompts()) == one_rank[name]
        pool = llm.engine.block_pool
        assert pool.num_free_blocks == pool.num_blocks
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive


DEFAULT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                   "Q: What is 7 times 8?\nA:"]


def test_the_default_model_over_two_stages_gives_one_rank_s_tokens() -> None:
    """SmolLM2's 30 layers as 15 + 15: greedy and seeded sampling as on one rank; each stage
    caches only its layers' KV, so the same budget holds twice the blocks."""
    greedy = SamplingParams(max_tokens=16, temperature=0)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, n=2)
    with LLM(kv_cache_memory="64MiB", num_threads=1) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(DEFAULT_PROMPTS, greedy)]
        expected_seeded = [[s.token_ids for s in o.outputs] for o in one.generate(DEFAULT_PROMPTS[:2], seeded)]
        blocks_one = one.engine.block_pool.num_blocks
    with LLM(kv_cache_memory="64MiB", num_threads=1, pipeline_parallel_size=2) as two:
        assert [o.outputs[0].token_ids for o in two.generate(DEFAULT_PROMPTS, greedy)] == expected
        assert [[s.token_ids for s in o.outputs] for o in two.generate(DEFAULT_PROMPTS[:2], seeded)] == expected_seeded
        # Each a floor of the same budget over a block (half of it a stage): twice, or one more.
        blocks_two = two.engine.block_pool.num_blocks
        assert blocks_two in (2 * blocks_one, 2 * blocks_one + 1)
        core = two.engine.core
        split = memory_split_lines(core.config, core.worker_infos, core.num_blocks)
    assert [line.split(":")[0] for line in split] == ["rank 0 (stage 0, layers 0-14, tp rank 0)",
                                                       "rank 1 (stage 1, layers 15-29, tp rank 0)"]
    # Each stage holds half the layers and one of embedding / head: what the plan says, and
    # what the ranks measure.
    assert all("weights 0.30 GiB" in line and "planned: weights 0.30 GiB" in line for line in split)
    assert all(f"KV 0.06 GiB = {blocks_two} blocks" in line for line in split)


@pytest.mark.parametrize("victim", [0, 1])
def test_a_stage_killed_mid_run_stops_the_engine_naming_it(victim: int) -> None:
    from tandem.executor.base import WorkerDiedError

    llm = LLM(kv_cache_memory="64MiB", num_threads=1, pipeline_parallel_size=2)
    ranks = [psutil.Process(p.pid) for p in llm.engine.core.executor._procs]
    engine = llm.engine
    try:
        engine.add_request(None, DEFAULT_PROMPTS[0], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        for _ in range(6):
            engine.step()  # mid-run: micro-batches in flight
        ranks[victim].kill()
        with pytest.raises(WorkerDiedError, match=rf"rank {victim} \(pid {ranks[victim].pid}\) exited with code -9"):
            for _ in range(400):
                engine.step()
    finally:
        llm.shutdown()
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, f"ranks left behind: {[p.pid for p in alive]}"


@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_speculation_over_split_engines_gives_one_rank_s_tokens(split: dict) -> None:
    """Every rank builds the same verification chunk from the plain output's drafts; the
    output rank verifies; a pipeline keeps the request out of the next micro-batch until
    its verified tokens are in."""
    prompts = ["Count: 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,", "def fibonacci(n):"]
    greedy = SamplingParams(max_tokens=24, temperature=0)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    with LLM(kv_cache_memory="64MiB", num_threads=1) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, greedy, use_tqdm=False)]
    with LLM(kv_cache_memory="64MiB", num_threads=1, speculative_config=spec, **split) as two:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, greedy, use_tqdm=False)] == expected
        assert two.engine.core.speculator.stats.num_accepted_tokens > 0
