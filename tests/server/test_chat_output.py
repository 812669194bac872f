"""A sequence's output through both parsers: reasoning first, then tool calls in the answer."""

from __future__ import annotations

import json

from tandem.server.chat_output import OutputDelta, SequenceOutput
from tandem.server.reasoning.think_tags import ThinkTagsParser
from tandem.server.tool_parsers import HermesToolParser, KimiK2ToolParser
from tests.support.tool_stream_helpers import splits

PROMPT = "<|im_start|>assistant\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXT = f"<think>The user wants the weather. <tool_call> is how I call.</think>\n\nChecking.\n{CALL}"


def run(output: SequenceOutput, chunks: list[str]) -> OutputDelta:
    got = OutputDelta()
    for i, chunk in enumerate(chunks):
        piece = output.feed(chunk, final=i == len(chunks) - 1)
        got.reasoning += piece.reasoning
        got.content += piece.content
        got.tool_calls += piece.tool_calls
    return got


def start(forced: str = "", reasoning: bool = True) -> SequenceOutput:
    return SequenceOutput.start(PROMPT + forced, forced, ThinkTagsParser() if reasoning else None,
                                HermesToolParser(), {"get_weather": {}})


def test_reasoning_is_taken_out_before_the_calls_are_parsed() -> None:
    whole = run(start(), [TEXT])
    assert whole.reasoning == "The user wants the weather. <tool_call> is how I call."
    assert whole.content == "Checking."
    [call] = whole.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    for chunks in splits(TEXT, seed=3, random_rounds=3):
        got = run(start(), chunks)
        assert (got.reasoning, got.content) == (whole.reasoning, whole.content), chunks
        assert "".join(c.arguments for c in got.tool_calls) == call.arguments


def test_without_a_reasoning_parser_the_thinking_is_answer_text_and_can_spoil_the_call() -> None:
    """Why reasoning goes first: the thinking mentions the call tag, which the tool parser then
    takes for a call's start; the real call after it is lost in text."""
    got = run(start(reasoning=False), [TEXT])
    assert got.reasoning == "" and got.content.startswith("<think>") and got.tool_calls == []


def test_a_forced_call_is_never_reasoning() -> None:
    forced = HermesToolParser().forced_prefix("get_weather")
    got = run(start(forced), ['{"city": "Oslo"}}\n</tool_call>'])
    assert got.reasoning == "" and [c.name for c in got.tool_calls] == ["get_weather"]


def test_kimi_thinking_then_a_call() -> None:
    text = ("<think>Need the weather.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
    output = SequenceOutput.start(PROMPT, "", ThinkTagsParser(), KimiK2ToolParser(), {})
    got = run(output, [text[:40], text[40:]])
    assert got.reasoning == "Need the weather." and got.content == ""
    assert [c.id for c in got.tool_calls] == ["functions.get_weather:0"] and output.called_tools
