"""Hermes / Qwen2.5 format: what `parse` returns, what a stream holds back, and the prompt text."""

from __future__ import annotations

import json

from tandem.server.tool_parsers import HermesToolParser, ToolCall
from tests.support.tool_stream_helpers import run_stream, summary

P = HermesToolParser()
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def wrap(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_plain_text_is_content() -> None:
    msg = P.parse("Hello there.\n")
    assert msg.content == "Hello there.\n"
    assert msg.tool_calls == []


def test_blank_output_has_no_content() -> None:
    assert P.parse("").content is None
    assert P.parse(" \n ").content is None


def test_one_call() -> None:
    msg = P.parse(wrap(WEATHER))
    assert msg.content is None
    [call] = msg.tool_calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.arguments == '{"city": "Paris"}'
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24


def test_two_calls_have_distinct_ids() -> None:
    msg = P.parse(wrap(WEATHER) + "\n" + wrap('{"name": "get_time", "arguments": {}}'))
    assert msg.content is None
    assert [c.name for c in msg.tool_calls] == ["get_weather", "get_time"]
    assert msg.tool_calls[1].arguments == "{}"
    assert msg.tool_calls[0].id != msg.tool_calls[1].id


def test_text_around_calls_loses_only_the_separating_whitespace() -> None:
    msg = P.parse("Let me check.\n\n" + wrap(WEATHER) + "\n\nDone  \n")
    assert msg.content == "Let me check.\n\nDone  \n"
    assert [c.name for c in msg.tool_calls] == ["get_weather"]
    msg = P.parse("A.\n" + wrap(WEATHER) + "\n" + wrap(WEATHER) + "\nB.")
    assert msg.content == "A.\nB."
    msg = P.parse("\n" + wrap(WEATHER) + "\n\n" + wrap(WEATHER) + "\n\nDone")
    assert msg.content == "Done"


def test_invalid_json_is_content() -> None:
    text = "Try: " + wrap('{"name": "f", "arguments": {')
    msg = P.parse(text)
    assert msg.content == text
    assert msg.tool_calls == []


def test_missing_name_is_content() -> None:
    text = wrap('{"arguments": {"a": 1}}')
    assert P.parse(text).content == text
    assert P.parse(wrap('{"name": "", "arguments": {}}')).tool_calls == []


def test_non_object_arguments_are_content() -> None:
    assert P.parse(wrap('{"name": "f", "arguments": [1, 2]}')).tool_calls == []
    assert P.parse(wrap('{"name": "f", "arguments": "not json"}')).tool_calls == []


def test_invalid_call_between_valid_ones_stays_in_place() -> None:
    bad = wrap("{oops}")
    msg = P.parse(wrap(WEATHER) + "\n" + bad + "\n" + wrap(WEATHER))
    assert msg.content == bad
    assert len(msg.tool_calls) == 2


def test_unterminated_call_still_parses() -> None:
    for tail in ("", "\n", "\n</", "\n</tool_call"):
        msg = P.parse("On it.\n<tool_call>\n" + WEATHER + tail)
        assert msg.content == "On it.", tail
        assert [c.name for c in msg.tool_calls] == ["get_weather"], tail


def test_unterminated_invalid_call_is_content() -> None:
    text = 'Hmm <tool_call>\n{"name": "get_weather", "argu'
    msg = P.parse(text)
    assert msg.content == text
    assert msg.tool_calls == []


def test_arguments_as_string_and_parameters_alias() -> None:
    as_string = P.parse(wrap('{"name": "f", "arguments": "{\\"a\\": 1}"}')).tool_calls[0]
    assert as_string.arguments == '{"a": 1}'
    alias = P.parse(wrap('{"name": "f", "parameters": {"b": 2}}')).tool_calls[0]
    assert alias.arguments == '{"b": 2}'
    missing = P.parse(wrap('{"name": "f"}')).tool_calls[0]
    assert missing.arguments == "{}"


def test_unicode_arguments_are_not_escaped() -> None:
    msg = P.parse(wrap('{"name": "t", "arguments": {"q": "\\u6771\\u4eac", "e": "😀 café"}}'))
    assert msg.tool_calls[0].arguments == '{"q": "東京", "e": "😀 café"}'


def test_marker_lookalikes_stay_text() -> None:
    text = "Use a < b, <b>bold</b>, <tool> and <tool_cal"
    assert P.parse(text).content == text


def test_stream_holds_back_a_possible_marker() -> None:
    stream = P.stream()
    assert stream.feed("Checking <tool").content == "Checking"
    delta = stream.feed("_call>\n" + WEATHER)
    assert not delta
    delta = stream.feed("\n</tool_call>")
    assert delta.content == ""
    [piece] = delta.tool_calls
    assert (piece.index, piece.name, piece.arguments) == (0, "get_weather", '{"city": "Paris"}')
    assert stream.called_tools
    assert not stream.finish()


def test_stream_releases_a_lookalike_once_decided() -> None:
    stream = P.stream()
    assert stream.feed("a <too").content == "a"
    assert stream.feed("ls").content == " <tools"
    assert stream.finish().content == ""
    assert not stream.called_tools


def test_stream_flushes_trailing_text_and_unterminated_call_at_finish() -> None:
    stream = P.stream()
    assert stream.feed("Hi \n").content == "Hi"
    assert stream.finish().content == " \n"
    stream = P.stream()
    stream.feed("<tool_call>\n{bad")
    assert stream.finish().content == "<tool_call>\n{bad"
    assert not stream.called_tools


def test_stream_matches_parse_on_a_mixed_response() -> None:
    text = "Sure.\n" + wrap(WEATHER) + "\n" + wrap("{bad}") + "\nBye"
    chunks = [text[i : i + 3] for i in range(0, len(text), 3)]
    assert summary(run_stream(P, chunks)) == summary(P.parse(text))


def test_forced_prefix_contract() -> None:
    required = P.forced_prefix(None)
    assert required == "<tool_call>\n"
    named = P.forced_prefix("get_weather")
    assert named == '<tool_call>\n{"name": "get_weather", "arguments": '
    for prefix, generated in [
        (required, WEATHER + "\n</tool_call>"),
        (named, '{"city": "Paris"}}\n</tool_call>'),
        (named, '{"city": "Paris"}}'),  # stopped on </tool_call>
    ]:
        msg = P.parse(prefix + generated)
        assert msg.content is None
        assert [(c.name, c.arguments) for c in msg.tool_calls] == [
            ("get_weather", '{"city": "Paris"}')
        ]
        stream = P.stream(prefix)
        streamed = [stream.feed(generated), stream.finish()]
        assert [p.name for d in streamed for p in d.tool_calls] == ["get_weather"]
        assert "".join(d.content for d in streamed) == ""
        assert run_stream(P, [generated], prefix=prefix).tool_calls[0].name == "get_weather"


def test_stop_strings() -> None:
    assert P.stop_strings() == []
    assert P.stop_strings(parallel_tool_calls=False) == ["</tool_call>"]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "now", "description": "Heure 🕒"}},
]


def test_system_prompt_is_qwen25_text() -> None:
    expected = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(TOOLS[0], ensure_ascii=False)
        + "\n"
        + '{"type": "function", "function": {"name": "now", "description": "Heure 🕒"}}'
        + "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    assert P.system_prompt(TOOLS) == expected
    assert P.system_prompt(TOOLS, system="You are terse.") == "You are terse.\n\n" + expected


def test_render_history_round_trips_through_parse() -> None:
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "東京"}'},
        },
        ToolCall(id="call_2", name="now", arguments="{}"),
    ]
    rendered = P.render_tool_calls(calls)
    assert rendered == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    )
    msg = P.parse(P.render_assistant("Checking.", calls))
    assert msg.content == "Checking."
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [
        ("get_weather", '{"city": "東京"}'),
        ("now", "{}"),
    ]
    assert P.render_assistant(None, calls) == rendered
    assert P.render_assistant("Just text.", []) == "Just text."


def test_render_keeps_unparsable_history_arguments_as_text() -> None:
    rendered = P.render_tool_calls([{"function": {"name": "f", "arguments": "{oops"}}])
    assert rendered == '<tool_call>\n{"name": "f", "arguments": "{oops"}\n</tool_call>'


def test_render_tool_result() -> None:
    assert P.render_tool_result('{"temp": 21}', "get_weather") == (
        '<tool_response>\n{"temp": 21}\n</tool_response>'
    )


BARE = '{"name": "read", "arguments": {"filePath": "calc.py"}}'


def test_bare_call_naming_a_declared_function_is_a_call() -> None:
    # Qwen2.5-Coder-0.5B's answer to OpenCode's first turn, greedy: no <tool_call> tags.
    for text in (BARE, f"```json\n{BARE}\n```", f"\n```\n{BARE}\n", f"{BARE}\n{BARE}"):
        parsed = HermesToolParser().parse(text, {"read", "bash"})
        assert parsed.content is None, text
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
            ("read", {"filePath": "calc.py"})] * text.count('"name"'), text


def test_bare_json_is_content_unless_every_object_is_a_declared_call() -> None:
    parser = HermesToolParser()
    for text, names in ((BARE, set()), (BARE, {"bash"}), (f"{BARE} then prose", {"read"}),
                        ('{"answer": 42}', {"read"}), (f"Sure:\n```json\n{BARE}\n```", {"read"}),
                        (f"```python\n{BARE}\n```", {"read"})):
        parsed = parser.parse(text, names)
        assert parsed.tool_calls == [], (text, names)
        assert parsed.content == text, (text, names)


def test_stream_holds_a_possible_bare_call_and_releases_text_once_decided() -> None:
    stream = HermesToolParser().stream(tool_names={"read"})
    assert not stream.feed("```")
    assert not stream.feed("json\n{")
    assert not stream.feed('"name": "read", "arguments": {}}\n```')
    done = stream.finish()
    assert done.content == "" and [c.name for c in done.tool_calls] == ["read"]
    assert stream.called_tools
    stream = HermesToolParser().stream(tool_names={"read"})
    assert not stream.feed("``")
    assert stream.feed("`py").content == "```py"
    assert stream.feed("thon").content == "thon"
