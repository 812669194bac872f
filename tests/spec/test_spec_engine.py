"""Speculative decoding end to end on the default model: the output never changes.

Greedy requests give the same tokens with and without drafts, batched, for every
token-only proposer and for fixed and adaptive k, including requests whose sampling rows
depend on the drafts (penalties, min_tokens) and requests that ask for logprobs. A seeded
sampled request gives the same output on every run. The prompts are agent-like (code to
copy, a tool call to repeat) so most steps carry drafts that are partly accepted.
"""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams

CODE = ("Here is a function:\n```python\ndef area(width, height):\n    return width * height\n```\n"
        "Repeat the function exactly, then add a docstring.")
TOOL = ('Call the tool again with the same arguments: {"name": "read_file", "arguments": '
        '{"path": "src/app/main.py", "start": 1, "end": 40}}')
PROSE = "Write two sentences about the sea."

METHODS = [
    {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "suffix", "num_speculative_tokens": 8, "adaptive": False},
    {"method": "suffix", "num_speculative_tokens": 6},
    {"method": "suffix", "num_speculative_tokens": 8, "adaptive": False, "suffix_decoding_prompt_lookup": False},
]


def _spec_id(spec: dict) -> str:
    lookup = "" if spec.get("suffix_decoding_prompt_lookup", True) else "-trees-only"
    return f"{spec['method']}{lookup}-{'adaptive' if spec.get('adaptive', True) else 'fixed'}"


def chat(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list:
    return llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)


def requests() -> tuple[list[str], list[SamplingParams]]:
    prompts = [CODE, TOOL, PROSE, CODE, TOOL, CODE]
    params = [
        SamplingParams(temperature=0, max_tokens=60),
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0, max_tokens=30),
        SamplingParams(temperature=0, max_tokens=50, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=40, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=20, stop=["height"]),
    ]
    return prompts, params


@pytest.fixture(scope="module")
def plain() -> list:
    with LLM(kv_cache_memory="128MiB") as llm:
        return chat(llm, *requests())


@pytest.mark.parametrize("spec", METHODS, ids=_spec_id)
def test_greedy_output_is_identical_with_speculation(plain: list, spec: dict) -> None:
    with LLM(kv_cache_memory="128MiB", speculative_config=spec) as llm:
        outputs = chat(llm, *requests())
        stats = llm.engine.core.speculator.stats
        engine = llm.engine
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    for got, want in zip(outputs, plain, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == want.outputs[0].text
        assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
        if want.outputs[0].logprobs is not None:
            for mine, theirs in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
                assert [t.token_id for t in mine] == [t.token_id for t in theirs]
                assert [t.logprob for t in mine] == pytest.approx([t.logprob for t in theirs], abs=1e-3)
    assert stats.num_accepted_tokens > 20  # the prompts are made to be copied: drafts did land


def test_a_seeded_request_repeats_itself_with_speculation() -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=40)
    with LLM(kv_cache_memory="128MiB", speculative_config=METHODS[0]) as llm:
        first = chat(llm, [CODE, TOOL], [params, params])
        second = chat(llm, [TOOL, CODE], [params, params])
        assert llm.engine.core.speculator.stats.num_drafts > 0
    assert first[0].outputs[0].token_ids == second[1].outputs[0].token_ids
    assert first[1].outputs[0].token_ids == second[0].outputs[0].token_ids


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_a_quantized_cache_gives_the_same_tokens_with_speculation(kv_cache_dtype: str) -> None:
    """--kv-cache-dtype int8 or fp8: a verify step reads the drafts' keys as rounded rows (or
    e4m3 values), exactly as one decode a token reads its own, so the greedy tokens are the
    cache's own without drafts."""
    with LLM(kv_cache_memory="128MiB", kv_cache_dtype=kv_cache_dtype) as llm:
        want = chat(llm, *requests())
    with LLM(kv_cache_memory="128MiB", kv_cache_dtype=kv_cache_dtype, speculative_config=METHODS[2]) as llm:
        got = chat(llm, *requests())
        stats = llm.engine.core.speculator.stats
        assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert stats.num_accepted_tokens > 20
