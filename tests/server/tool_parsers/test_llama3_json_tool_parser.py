"""Llama 3.1 / 3.2 JSON format: a response is all calls or all text, decided on its start."""

from __future__ import annotations

import json

from tandem.server.tool_parsers import Llama3JsonToolParser
from tests.support.tool_stream_helpers import run_stream, summary

P = Llama3JsonToolParser()
WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


def names_args(text: str) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in P.parse(text).tool_calls]


def test_plain_text_is_content() -> None:
    msg = P.parse("The weather is nice.")
    assert msg.content == "The weather is nice."
    assert msg.tool_calls == []
    assert P.parse("  \n").content is None


def test_one_call_with_or_without_python_tag() -> None:
    for text in (WEATHER, "<|python_tag|>" + WEATHER, "\n <|python_tag|>\n" + WEATHER + "\n"):
        msg = P.parse(text)
        assert msg.content is None, text
        assert [(c.name, c.arguments) for c in msg.tool_calls] == [
            ("get_weather", '{"city": "Paris"}')
        ]


def test_several_calls() -> None:
    text = WEATHER + '; {"name": "now", "parameters": {}}'
    msg = P.parse(text)
    assert [c.name for c in msg.tool_calls] == ["get_weather", "now"]
    assert len({c.id for c in msg.tool_calls}) == 2
    assert names_args(WEATHER + "\n" + WEATHER) == [("get_weather", '{"city": "Paris"}')] * 2


def test_text_first_means_no_call() -> None:
    text = "Here you go: " + WEATHER
    assert P.parse(text).content == text
    assert P.parse(text).tool_calls == []


def test_invalid_json_or_not_a_call_is_content() -> None:
    for text in ('{"name": "get_weather", "parameters": {"city": ', '{"a": 1} is JSON'):
        msg = P.parse(text)
        assert msg.content == text
        assert msg.tool_calls == []


def test_text_after_calls_is_content() -> None:
    msg = P.parse(WEATHER + "; and then I will tell you.")
    assert msg.content == "and then I will tell you."
    assert [c.name for c in msg.tool_calls] == ["get_weather"]
    msg = P.parse(WEATHER + '; {"name": "now", "parameters": {')
    assert msg.content == '{"name": "now", "parameters": {'
    assert P.parse(WEATHER + ";").content is None


def test_arguments_alias_string_arguments_and_unicode() -> None:
    assert names_args('{"name": "f", "arguments": {"a": 1}}') == [("f", '{"a": 1}')]
    assert names_args('{"name": "f", "parameters": "{\\"a\\": 1}"}') == [("f", '{"a": 1}')]
    assert names_args('{"name": "f", "parameters": {"q": "\\u00e9t\\u00e9 東京"}}') == [
        ("f", '{"q": "été 東京"}')
    ]


def test_builtin_python_tag_code_is_content() -> None:
    text = "<|python_tag|>print('hi')"
    assert P.parse(text).content == text


def test_stream_emits_text_at_once() -> None:
    stream = P.stream()
    assert stream.feed(" ").content == ""
    assert stream.feed("Hi").content == " Hi"
    assert stream.feed(" {there}").content == " {there}"
    assert not stream.finish()
    assert not stream.called_tools


def test_stream_holds_a_possible_call_until_finish() -> None:
    stream = P.stream()
    chunks = ["<|python", "_tag|>", WEATHER[:10], WEATHER[10:]]
    assert not any(stream.feed(c) for c in chunks)
    out = stream.finish()
    assert out.content == ""
    [piece] = out.tool_calls
    assert (piece.index, piece.name, piece.arguments) == (0, "get_weather", '{"city": "Paris"}')
    assert piece.id is not None and piece.id.startswith("call_")
    assert stream.called_tools


def test_stream_releases_a_tag_lookalike() -> None:
    stream = P.stream()
    assert stream.feed("<|py").content == ""
    assert stream.feed("x|> hi").content == "<|pyx|> hi"


def test_stream_matches_parse() -> None:
    text = WEATHER + "; trailing words"
    assert summary(run_stream(P, list(text))) == summary(P.parse(text))


def test_forced_prefix_contract() -> None:
    assert P.forced_prefix(None) == '{"name": "'
    named = P.forced_prefix("get_weather")
    assert named == '{"name": "get_weather", "parameters": '
    for prefix, generated in [
        (P.forced_prefix(None), 'get_weather", "parameters": {"city": "Paris"}}'),
        (named, '{"city": "Paris"}}'),
    ]:
        msg = P.parse(prefix + generated)
        assert msg.content is None
        assert [(c.name, c.arguments) for c in msg.tool_calls] == [
            ("get_weather", '{"city": "Paris"}')
        ]
        stream = P.stream(prefix)
        assert not stream.feed(generated)
        assert [p.name for p in stream.finish().tool_calls] == ["get_weather"]
    assert P.stop_strings(parallel_tool_calls=False) == []


def test_system_prompt_is_llama31_text() -> None:
    tools = [{"type": "function", "function": {"name": "now", "description": "Heure"}}]
    text = P.system_prompt(tools)
    assert text.startswith(
        "Given the following functions, please respond with a JSON for a function call with "
        "its proper arguments that best answers the given prompt.\n\nRespond in the format "
        '{"name": function name, "parameters": dictionary of argument name and its value}. '
        "Do not use variables.\n\n{\n"
    )
    assert text.endswith(json.dumps(tools[0], indent=4))
    assert P.system_prompt(tools, system="Be brief.").startswith("Be brief.\n\nGiven the")


def test_render_history_round_trips_through_parse() -> None:
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "a", "arguments": '{"x": "é"}'}},
        {"id": "c2", "type": "function", "function": {"name": "b", "arguments": ""}},
    ]
    rendered = P.render_tool_calls(calls)
    assert rendered == '{"name": "a", "parameters": {"x": "é"}}; {"name": "b", "parameters": {}}'
    assert names_args(rendered) == [("a", '{"x": "é"}'), ("b", "{}")]
    assert P.render_tool_result("21 C", "get_weather") == "21 C"
