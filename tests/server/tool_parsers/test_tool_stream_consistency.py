"""Streaming must reproduce the non-streaming result however the text is split into deltas.

Each case is fed as every fixed chunk size (1 = character by character), cut once at every
position, and cut at random: content and every call's name and arguments must come out the
same as `parse` on the whole text, with ids and names once per call.
"""

from __future__ import annotations

import pytest

from tandem.server.tool_parsers import (
    DeepSeekV3ToolParser,
    DeepSeekV31ToolParser,
    HermesToolParser,
    KimiK2ToolParser,
    Llama3JsonToolParser,
    Qwen3CoderToolParser,
    ToolParser,
)
from tests.support.tool_stream_helpers import run_stream, splits, summary

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
CALL2 = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'

HERMES_CASES = [
    "",
    "   \n",
    "Hello, world!",
    "Hello, world!\n\n",
    "  leading spaces kept",
    f"<tool_call>\n{CALL}\n</tool_call>",
    f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL2}\n</tool_call>",
    f"<tool_call>{CALL}</tool_call><tool_call>{CALL2}</tool_call>",
    f"Let me check.\n\n<tool_call>\n{CALL}\n</tool_call>",
    f"Before.\n<tool_call>\n{CALL}\n</tool_call>\n\nAfter.\n",
    "<tool_call>\n{not json}\n</tool_call>",
    'Text <tool_call>\n{"arguments": {}}\n</tool_call> more',
    f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{{bad\n</tool_call>\n"
    f"<tool_call>\n{CALL2}\n</tool_call>",
    f"<tool_call>\n{CALL}\n",
    f"Sure.\n<tool_call>\n{CALL}\n</tool",
    '<tool_call>\n{"name": "f", "arguments": {"a"',
    '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
    '<tool_call>\n{"name": "f", "parameters": {"a": [1, 2]}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": null}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
    '<tool_call>\n{"name": "translate", "arguments": {"text": "東京 😀 café"}}\n</tool_call>',
    "a < b, <b>bold</b>, <tool> and <tool_cal",
    "ends with a partial marker <tool_ca",
    "<<tool_call>\n" + CALL + "\n</tool_call>>",
    "x<tool_call>",
]

# Bare calls (no tags), parsed when the request declared get_weather and get_time; with no
# declared names every case must stream as the plain Hermes parser streams it.
DECLARED = frozenset({"get_weather", "get_time"})
BARE_CASES = [
    CALL,
    f"  \n{CALL}\n",
    f"```json\n{CALL}\n```",
    f"```\n{CALL}\n```\n",
    f"```json\n{CALL}\n",
    f"{CALL}\n{CALL2}",
    '{"name": "undeclared", "arguments": {}}',
    f"{CALL} and then some words",
    '{"answer": 42}',
    '{"name": "get_weather", "arguments": {"city": ',
    f"```python\nprint(1)\n```\n<tool_call>\n{CALL}\n</tool_call>",
    f"``` json\n{CALL}```",
    "```js",
    "``",
    f"`{CALL}`",
    f"Sure.\n```json\n{CALL}\n```",
    f"<tool_call>\n{CALL}\n</tool_call>",
]

LLAMA_CASES = [
    "",
    "  \n ",
    "Hello, world!",
    "  indented text\n",
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    ' \n<|python_tag|> {"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
    '{"name": "a", "parameters": {}}\n{"name": "b", "arguments": {"y": "東京"}}',
    '{"name": "get_weather", "parameters": {"city": ',
    '{"a": 1} is a JSON object',
    '{"name": "f", "parameters": "{\\"q\\": 2}"}',
    '{"name": "f", "parameters": {}} and some words',
    '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {',
    "<|python_tag|>print('hi')",
    "<|python_t",
    "<|python_tag|>",
    "<b>bold</b>",
]


_S, _E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
_B, _A, _C = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
KIMI_CALL = f'{_B}functions.get_weather:0{_A}{{"city": "Paris", "unit": "c"}}{_C}'
KIMI_CALL2 = f'{_B}functions.get_time:1{_A}{{"tz": "Europe/Paris"}}{_C}'
KIMI_CASES = [
    "",
    " \n",
    "Hello, world!\n",
    f"{_S}{KIMI_CALL}{_E}",
    f"{_S}{KIMI_CALL}{KIMI_CALL2}{_E}",
    f"{_S}\n{KIMI_CALL}\n{KIMI_CALL2}\n{_E}\n",
    f"Let me check the weather.\n\n{_S}{KIMI_CALL}{_E}",
    f"Before. {_S}{KIMI_CALL}{_E} After.",
    f"{_S}{KIMI_CALL}{_E}\n\nDone.",
    f"{KIMI_CALL}",  # no section markers
    f"{_S}{_B}get_weather:3{_A}{{}}{_C}{_E}",  # no functions. prefix
    f"{_S}{_B}functions.get_weather:0{_A}{{not json}}{_C}{_E}",
    f"{_S}{_B}no header{_A}{{}}{_C}{_E}",
    f"{_S}{_B}functions.f:0{_A}[1, 2]{_C}{_E}",
    f"{_S}{KIMI_CALL}{_B}functions.f:1{_A}{{bad{_C}{KIMI_CALL2}{_E}",
    f"{_S}{_B}functions.get_weather:0{_A}{{\"city\": \"東京 😀\"}}",  # cut before its end
    f"{_S}{_B}functions.get_weather:0{_A}{{\"city\": \"Par",  # cut inside the arguments
    f"Sure.{_S}{_B}functions.get_weather:0{_A}{{}}<|tool_ca",
    f"{_S}then words, not calls",
    "ends with a partial marker <|tool_calls_sec",
    "<|tool_call|> is not a marker, nor <|im_end|>",
]

_DS, _DE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DB, _DP, _DC = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
V3_CALL = f'{_DB}function{_DP}get_weather\n```json\n{{"city": "Paris", "unit": "c"}}\n```{_DC}'
V3_CALL2 = f'{_DB}function{_DP}get_time\n```json\n{{"tz": "Europe/Paris"}}\n```{_DC}'
DEEPSEEK_V3_CASES = [
    "",
    " \n",
    "Hello, world!\n",
    f"{_DS}{V3_CALL}{_DE}",
    f"{_DS}{V3_CALL}\n{V3_CALL2}{_DE}",
    f"Let me check the weather.\n\n{_DS}{V3_CALL}{_DE}",
    f"Before. {_DS}{V3_CALL}{_DE} After.",
    f"{_DS}{V3_CALL}{_DE}\n\nDone.",
    f"{V3_CALL}",  # no section markers
    f"{_DS}{_DB}function{_DP}f\n```json\n{{not json}}\n```{_DC}{_DE}",
    f"{_DS}{_DB}function{_DP}f\n```json\n[1]\n```{_DC}{_DE}",
    f"{_DS}{_DB}get_weather{_DP}{{}}{_DC}{_DE}",  # V3.1's call
    f"{_DS}{V3_CALL}{_DB}function{_DP}f\n```json\n{{bad\n```{_DC}{V3_CALL2}{_DE}",
    f"{_DS}{_DB}function{_DP}get_weather\n```json\n{{\"city\": \"東京 😀\"}}\n``",  # cut in the fence
    f"{_DS}{_DB}function{_DP}get_weather\n```json\n{{\"city\": \"Par",  # cut inside the arguments
    f"Sure.{_DS}{_DB}function{_DP}get_weather\n```json\n{{}}\n```<｜tool▁ca",
    f"{_DS}then words, not calls",
    "ends with a partial marker <｜tool▁calls▁be",
    "<｜tool▁output▁begin｜> is not a call marker, nor <｜end▁of▁sentence｜>",
]
V31_CALL = f'{_DB}get_weather{_DP}{{"city": "Paris", "unit": "c"}}{_DC}'
V31_CALL2 = f'{_DB}get_time{_DP}{{"tz": "Europe/Paris"}}{_DC}'
DEEPSEEK_V31_CASES = [
    "",
    " \n",
    "Hello, world!\n",
    f"{_DS}{V31_CALL}{_DE}",
    f"{_DS}{V31_CALL}{V31_CALL2}{_DE}",
    f"{_DS}\n{V31_CALL}\n{V31_CALL2}\n{_DE}\n",
    f"Let me check the weather.\n\n{_DS}{V31_CALL}{_DE}",
    f"Before. {_DS}{V31_CALL}{_DE} After.",
    f"{_DS}{V31_CALL}{_DE}\n\nDone.",
    f"{V31_CALL}",  # no section markers
    f"{_DS}{_DB}get_time{_DP}{_DC}{_DE}",  # no arguments: {}
    f"{_DS}{_DB}get_weather{_DP}{{not json}}{_DC}{_DE}",
    f"{_DS}{_DB}no name{_DP}{{}}{_DC}{_DE}",
    f"{_DS}{_DB}f{_DP}[1, 2]{_DC}{_DE}",
    f"{_DS}{V31_CALL}{_DB}f{_DP}{{bad{_DC}{V31_CALL2}{_DE}",
    f"{_DS}{_DB}get_weather{_DP}{{\"city\": \"東京 😀\"}}",  # cut before its end
    f"{_DS}{_DB}get_weather{_DP}{{\"city\": \"Par",  # cut inside the arguments
    f"Sure.{_DS}{_DB}get_weather{_DP}{{}}<｜tool▁ca",
    f"{_DS}then words, not calls",
    "ends with a partial marker <｜tool▁calls▁be",
]



def qwen_call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


QWEN_WEATHER = qwen_call("get_weather", ("city", "Paris"), ("days", "3"))
QWEN_TIME = qwen_call("get_time", ("tz", "Europe/Paris"))
# The schemas the server passes as tool_names: each value is typed by them.
QWEN_SCHEMAS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
        "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
        "when": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}},
    "get_time": {"type": "object", "properties": {"tz": {"type": "string"}}},
}
QWEN3_CODER_CASES = [
    "",
    " \n",
    "Hello, world!\n",
    QWEN_WEATHER,
    f"{QWEN_WEATHER}\n{QWEN_TIME}",
    f"{QWEN_WEATHER}{QWEN_TIME}",
    f"Let me check.\n\n{QWEN_WEATHER}",
    f"Before.\n{QWEN_WEATHER}\n\nAfter.\n",
    qwen_call("get_weather", ("temp", "21.5"), ("metric", "TRUE"), ("opts", '{"a": [1, 2]}'),
              ("tags", '["x", "東京 😀"]'), ("when", "null"), ("days", "three")),
    qwen_call("get_weather", ("opts", "{not json"), ("temp", "nan"), ("when", "7")),
    qwen_call("get_weather", ("city", "line one\n</para\n  indented <b>\n")),
    qwen_call("get_time"),  # no parameters
    qwen_call("undeclared", ("x", "1")),
    qwen_call("get_weather", ("city", "a"), ("city", "b")),  # repeated: the first stands
    "<tool_call>\n<function=get_weather>\n<parameter=city>\n\n</parameter>\n</function>",
    "<tool_call><function=get_weather><parameter=city>Paris</parameter></function></tool_call>",
    # cut off: counts when no parameter is left open
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</func",
    "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
    "<tool_call>\n<function=get_weather>\n<parameter=ci",
    "<tool_call>\n<function=get_weather>\n<par",
    "<tool_call>\n<function=get_weather>\n",
    "<tool_call>\n<function=get_wea",
    # broken before the call is committed: all text
    "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>",
    "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",
    "Text <tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call> more",
    f"<tool_call>\n<function=get_weather>\n{QWEN_TIME}",
    # broken after it is committed: the call ends there, the rest is text
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "junk\n</function>\n</tool_call> tail",
    "Before. <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "\n junk <parameter=days>\n3\n</parameter>",
    "Before. <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=bad name>\nx\n</parameter>\n</function>",
    "Before.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3",
    f"Hi <tool_call>\n<function=get_weather>\n<parameter=>\nx\n</parameter>\n</function>\n{QWEN_TIME}",
    f"{QWEN_WEATHER.removesuffix('</tool_call>')}then text\n{QWEN_TIME}",
    f"{QWEN_WEATHER.removesuffix('</tool_call>')}{QWEN_TIME}",
    "a < b, <b>bold</b>, <function=x> and <tool_cal",
    "<<tool_call>\n<function=f>\n</function>\n</tool_call>>",
    "x<tool_call>",
]


@pytest.mark.parametrize(
    ("parser", "text"),
    [(HermesToolParser(), t) for t in HERMES_CASES]
    + [(Llama3JsonToolParser(), t) for t in LLAMA_CASES]
    + [(KimiK2ToolParser(), t) for t in KIMI_CASES]
    + [(DeepSeekV3ToolParser(), t) for t in DEEPSEEK_V3_CASES]
    + [(DeepSeekV31ToolParser(), t) for t in DEEPSEEK_V31_CASES]
    + [(Qwen3CoderToolParser(), t) for t in QWEN3_CODER_CASES],
    ids=lambda x: x.name if isinstance(x, ToolParser) else repr(x)[:40],
)
def test_every_split_matches_parse(parser: ToolParser, text: str) -> None:
    expected = summary(parser.parse(text))
    for chunks in splits(text, seed=len(text)):
        assert summary(run_stream(parser, chunks)) == expected, chunks


@pytest.mark.parametrize("names", [DECLARED, frozenset()], ids=["declared", "undeclared"])
@pytest.mark.parametrize("text", BARE_CASES + HERMES_CASES, ids=lambda t: repr(t)[:40])
def test_hermes_bare_calls_every_split_match_parse(text: str, names: frozenset[str]) -> None:
    parser = HermesToolParser()
    expected = summary(parser.parse(text, names))
    for chunks in splits(text, seed=len(text), random_rounds=5):
        assert summary(run_stream(parser, chunks, tool_names=names)) == expected, chunks


@pytest.mark.parametrize("text", QWEN3_CODER_CASES, ids=lambda t: repr(t)[:40])
def test_qwen3_coder_typed_by_schemas_every_split_matches_parse(text: str) -> None:
    parser = Qwen3CoderToolParser()
    expected = summary(parser.parse(text, QWEN_SCHEMAS))
    for chunks in splits(text, seed=len(text), random_rounds=5):
        assert summary(run_stream(parser, chunks, tool_names=QWEN_SCHEMAS)) == expected, chunks


def test_qwen3_coder_streams_a_call_before_it_is_complete() -> None:
    """The name goes out when the body starts, each argument when its parameter closes."""
    stream = Qwen3CoderToolParser().stream(tool_names=QWEN_SCHEMAS)
    head, _, rest = QWEN_WEATHER.partition("<parameter=city>")
    assert not stream.feed(head)  # `<function=NAME>` alone commits nothing (forced prefixes end there)
    [first] = stream.feed("<parameter=city>").tool_calls
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "")
    assert first.id is not None and first.id.startswith("call_")
    value, _, rest = rest.partition("</parameter>")
    assert not stream.feed(value)
    assert [p.arguments for p in stream.feed("</parameter>").tool_calls] == ['{"city": "Paris"']
    before_end, _, rest = rest.partition("</function>")
    assert [p.arguments for p in stream.feed(before_end).tool_calls] == [', "days": 3']
    assert [(p.name, p.arguments) for p in stream.feed("</function>").tool_calls] == [(None, "}")]
    assert not stream.feed(rest) and not stream.finish()
    assert stream.called_tools


@pytest.mark.parametrize("parser", [HermesToolParser(), Llama3JsonToolParser(), KimiK2ToolParser(),
                                    DeepSeekV3ToolParser(), DeepSeekV31ToolParser(), Qwen3CoderToolParser()],
                         ids=lambda parser: type(parser).__name__)
@pytest.mark.parametrize("name", [None, "get_weather"])
def test_forced_prefix_every_split(parser: ToolParser, name: str | None) -> None:
    prefix = parser.forced_prefix(name)
    if name is None:
        full = parser.render_tool_calls([{"function": {"name": "get_weather", "arguments": "{}"}}])
    else:
        full = parser.render_tool_calls(
            [{"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
        )
    assert full.startswith(prefix)
    generated = full[len(prefix) :]
    expected = parser.parse(prefix + generated)
    assert [c.name for c in expected.tool_calls] == ["get_weather"]
    assert expected.content is None
    for chunks in splits(generated):
        assert summary(run_stream(parser, chunks, prefix=prefix)) == summary(expected)
