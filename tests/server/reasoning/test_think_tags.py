"""`<think>` reasoning apart from the answer: where a response starts (read off the prompt),
what each format returns, and a stream equal to the whole at every split."""

from __future__ import annotations

import pytest

from tandem.server.reasoning import REASONING_PARSERS, get_reasoning_parser
from tandem.server.reasoning.base import ReasoningDelta
from tandem.server.reasoning.think_tags import ThinkTagsParser, leaves_block_open
from tests.support.tool_stream_helpers import splits

P = ThinkTagsParser()
QWEN_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
R1_PROMPT = "<｜User｜>Hi<｜Assistant｜><think>\n"
NO_THINKING = QWEN_PROMPT + "<think>\n\n</think>\n\n"  # Qwen3 with enable_thinking=False


def split(text: str, prompt: str = QWEN_PROMPT) -> tuple[str, str]:
    out = P.parse(text, prompt)
    return out.reasoning, out.content


def test_the_prompt_says_where_the_output_starts() -> None:
    assert leaves_block_open(R1_PROMPT)
    assert not leaves_block_open(QWEN_PROMPT) and not leaves_block_open(NO_THINKING)
    assert leaves_block_open("<think>a</think> then <think>open")


def test_a_constraint_starts_after_reasoning_the_prompt_leaves_open() -> None:
    parser = ThinkTagsParser()
    assert parser.constraint_starts_after("<|im_start|>assistant\n<think>\n") == "</think>"
    assert parser.constraint_starts_after("<|im_start|>assistant\n<think>\n\n</think>\n\n") is None
    assert parser.constraint_starts_after("<|im_start|>assistant\n") is None


def test_each_start() -> None:
    assert split("<think>\nPlan: greet.\n</think>\n\nHello!") == ("\nPlan: greet.\n", "Hello!")
    assert split("Plan: greet.\n</think>\n\nHello!", R1_PROMPT) == ("Plan: greet.\n", "Hello!")
    assert split("Hello!") == ("", "Hello!")  # no block opened: all answer
    assert split("Hello!", NO_THINKING) == ("", "Hello!")
    assert split("<think>cut off mid-thought") == ("cut off mid-thought", "")  # never closed: all reasoning
    assert split("a <think> in the middle is text") == ("", "a <think> in the middle is text")
    assert split("  \n<think>x</think>y") == ("x", "y")
    assert split("<think>\nPlan.</think>Hi", R1_PROMPT) == ("\nPlan.", "Hi")  # the prompt's tag repeated
    assert split("", R1_PROMPT) == ("", "") and split("<thi", R1_PROMPT) == ("<thi", "")


CASES = [
    "", "  ", "Hello", "<think>", "<think></think>", "<think>a</think>b", "<think>a</think>\n\n b\n",
    "<thi", "<think>a</thi", "<think>a</think", "<think>a<think>b</think>c</think>d", "<<think>x</think>",
    "<think>東京 😀</think>café", "</think>x", "x</think>y",
]


@pytest.mark.parametrize("prompt", [QWEN_PROMPT, R1_PROMPT], ids=["qwen", "r1"])
@pytest.mark.parametrize("text", CASES, ids=repr)
def test_every_split_matches_the_whole(text: str, prompt: str) -> None:
    whole = P.parse(text, prompt)
    for chunks in splits(text, seed=len(text)):
        stream = P.stream(prompt)
        got = ReasoningDelta()
        for chunk in chunks:
            got.extend(stream.feed(chunk))
        got.extend(stream.finish())
        assert (got.reasoning, got.content) == (whole.reasoning, whole.content), chunks


def test_names() -> None:
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "kimi_k2"}
    assert isinstance(get_reasoning_parser("qwen3"), ThinkTagsParser)
    with pytest.raises(ValueError, match="supported: deepseek_r1, kimi_k2, qwen3"):
        get_reasoning_parser("o1")


def test_the_flag_offers_every_parser() -> None:
    from tandem.flags.engine import SERVER_FLAGS

    [flag] = [f for f in SERVER_FLAGS.flags if f.option == "--reasoning-parser"]
    assert set(flag.choices or ()) == set(REASONING_PARSERS)
