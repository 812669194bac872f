"""A KV cache dtype (--kv-cache-dtype) through the engine on the default model, measured as
the cache tests judge it: perplexity of 1,024 tokens in 64-token chunks, 8 greedy
continuations of 32 tokens with each step's margin between the two best tokens, and the same
prompts again, served from the prefix cache."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.bench.perplexity import long_text, perplexity
from tandem.llm import LLM
from tandem.types import SamplingParams

# A shared preamble of more than two blocks, so the second pass finds it cached.
PREAMBLE = ("Notes from a reading group. Each line starts a short passage that a student continues "
            "in their own words, plainly and without repeating the question.\n")
PROMPTS = [PREAMBLE + p for p in ("The capital of France is", "def fibonacci(n):",
                                  "Once upon a time, in a small village,", "List three colors:",
                                  "The quick brown fox", "import numpy as np\n", "Water boils at",
                                  "My favourite book is")]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)


@dataclass
class CacheRun:
    num_blocks: int
    block_bytes: int
    perplexity: float
    first: list[list[int]]  # each prompt's greedy continuation
    again: list[list[int]]  # the same, its prompt's blocks from the prefix cache
    margins: list[list[float]]  # nats between the two best tokens at each step of `first`
    first_steps: list[dict[int, float]]  # each prompt's first step in `first`: token id -> logprob
    again_steps: list[dict[int, float]]  # the same in `again`


def measure_cache(kv_cache_dtype: str) -> CacheRun:
    llm = LLM(kv_cache_memory="64MiB", kv_cache_dtype=kv_cache_dtype, block_size=16)  # short prompts fill blocks
    try:
        tokens = llm.tokenizer.encode(long_text())[:1024]
        value = perplexity(llm.engine, tokens, step_tokens=64)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        first = [list(o.outputs[0].token_ids) for o in outputs]
        margins = [[_margin(step) for step in o.outputs[0].logprobs] for o in outputs]
        repeated = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert all(o.num_cached_tokens >= 16 for o in repeated)  # whole blocks of the prompt came from the cache
        again = [list(o.outputs[0].token_ids) for o in repeated]
        first_steps = [_step(o.outputs[0].logprobs[0]) for o in outputs]
        again_steps = [_step(o.outputs[0].logprobs[0]) for o in repeated]
        pool = llm.engine.block_pool
        assert pool.num_free_blocks == pool.num_blocks
        core = llm.engine.core
        return CacheRun(core.num_blocks, core.worker_info.block_bytes, value, first, again, margins, first_steps,
                        again_steps)
    finally:
        llm.shutdown()


def first_departure(ours: list[int], reference: list[int]) -> int | None:
    """The first position where two continuations differ (None where they do not)."""
    return next((i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b), None)


def _step(step) -> dict[int, float]:
    """A step's logprobs by token id (the chosen token and the top two)."""
    return {entry.token_id: entry.logprob for entry in step}


def _margin(step) -> float:
    """Nats between a step's best and second-best tokens (its entries: the chosen token, then
    the top two by rank)."""
    best = sorted({entry.token_id: entry.logprob for entry in step}.values(), reverse=True)
    return best[0] - best[1]
