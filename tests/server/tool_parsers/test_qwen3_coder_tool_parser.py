"""Qwen3-Coder format: what `parse` returns (arguments typed by the declared schemas), broken
and cut-off markup, how earlier calls are written back, forcing, and the choice from a chat
template. That streaming agrees with `parse` at every split is checked with the other parsers
in test_tool_stream_consistency."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.server.tool_parsers import (
    TOOL_PARSERS,
    Qwen3CoderToolParser,
    ToolCall,
    detect_tool_parser,
    get_tool_parser,
)
from tandem.server.tool_parsers.qwen3_coder import convert_value

P = Qwen3CoderToolParser()

SCHEMAS: dict[str, Any] = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "temp": {"type": "number"},
            "metric": {"type": "boolean"},
            "opts": {"type": "object"},
            "tags": {"type": "array"},
            "nothing": {"type": "null"},
            "when": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "size": {"type": ["number", "string"]},
            "mode": {"oneOf": [{"type": "string"}, {"type": "boolean"}]},
            "free": {"description": "no type"},
        },
    },
    "get_time": {"type": "object", "properties": {"tz": {"type": "string"}}},
}


def block(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def calls(text: str, tool_names: Any = SCHEMAS) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in P.parse(text, tool_names).tool_calls]


def test_the_documented_example() -> None:
    text = "Some optional text first.\n" + block("get_weather", ("city", "Paris"), ("days", "3"))
    msg = P.parse(text, SCHEMAS)
    assert msg.content == "Some optional text first."
    [call] = msg.tool_calls
    assert call.id.startswith("call_") and call.name == "get_weather"
    assert call.arguments == '{"city": "Paris", "days": 3}'


@pytest.mark.parametrize(("param", "raw", "expected"), [
    ("city", "Paris", "Paris"),
    ("city", "42", "42"),  # a string stays one, however it looks
    ("city", "  two\nlines  ", "  two\nlines  "),  # only the layout newlines are stripped
    ("days", "3", 3),
    ("days", " -12 ", -12),
    ("days", "3.5", "3.5"),  # not an integer: kept as written
    ("days", "three", "three"),
    ("temp", "21.5", 21.5),
    ("temp", "21", 21),
    ("temp", "1e3", 1000.0),
    ("temp", "nan", "nan"),  # no NaN in JSON
    ("temp", "1e999", "1e999"),
    ("metric", "True", True),
    ("metric", "false", False),
    ("metric", "yes", "yes"),
    ("opts", '{"a": [1, 2]}', {"a": [1, 2]}),
    ("opts", "[1]", "[1]"),  # valid JSON, wrong type
    ("opts", "{not json", "{not json"),
    ("opts", '{"x": NaN}', '{"x": NaN}'),
    ("tags", '["x", "東京"]', ["x", "東京"]),
    ("nothing", "null", None),
    ("when", "7", 7),
    ("when", "null", None),
    ("when", "soon", "soon"),
    ("size", "12.5", 12.5),
    ("size", "large", "large"),
    ("mode", "true", True),  # non-string types are tried first
    ("mode", "fast", "fast"),
    ("free", "1", "1"),  # no type declared
    ("unknown", "1", "1"),  # not in the schema
])
def test_values_are_typed_by_the_schema(param: str, raw: str, expected: Any) -> None:
    [(name, arguments)] = calls(block("get_weather", (param, raw)))
    assert name == "get_weather"
    assert arguments == json.dumps({param: expected}, ensure_ascii=False)
    assert convert_value(raw, SCHEMAS["get_weather"]["properties"].get(param)) == expected


@pytest.mark.parametrize("tool_names", [{}, frozenset({"get_weather"}), {"other": {}},
                                        {"get_weather": {"type": "object"}}, {"get_weather": None}])
def test_without_a_schema_every_value_is_a_string(tool_names: Any) -> None:
    text = block("get_weather", ("days", "3"), ("opts", '{"a": 1}'), ("metric", "true"))
    assert calls(text, tool_names) == [
        ("get_weather", '{"days": "3", "opts": "{\\"a\\": 1}", "metric": "true"}')]


def test_several_calls_and_text_around_them() -> None:
    text = ("Checking both.\n\n" + block("get_weather", ("city", "東京 😀")) + "\n"
            + block("get_time", ("tz", "UTC")) + "\n\nDone.")
    msg = P.parse(text, SCHEMAS)
    assert msg.content == "Checking both.\n\nDone."
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [
        ("get_weather", '{"city": "東京 😀"}'), ("get_time", '{"tz": "UTC"}')]
    assert len({c.id for c in msg.tool_calls}) == 2
    # calls alone: no content at all
    assert P.parse(block("get_time") + "\n", SCHEMAS).content is None


def test_values_keep_everything_but_the_layout_newlines() -> None:
    value = "\ndef f():\n    return '<b>' + \"</para\"\n\n"
    [(_, arguments)] = calls(block("write", ("code", value)))
    assert json.loads(arguments) == {"code": value}


@pytest.mark.parametrize("text", [
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>",  # no <function=
    "<tool_call>\n<function=>\n</function>\n</tool_call>",  # empty name
    "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",  # no <parameter=
    "<tool_call>\n<function=get_weather>\n<parameter=>\nx\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=ci",  # cut before the call's body starts
    "<tool_call>\n<function=get_wea",
    "<tool_call>\n",
])
def test_markup_broken_before_the_body_starts_is_text_never_an_error(text: str) -> None:
    msg = P.parse("Well: " + text, SCHEMAS)
    assert msg.tool_calls == [] and msg.content == "Well: " + text


def test_markup_broken_after_the_body_starts_ends_the_call_there() -> None:
    head = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    # stray text between parameters: the call keeps what came before, the rest is content
    msg = P.parse(head + "oops\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", SCHEMAS)
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert msg.content == "oops\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    # a parameter left open at the end: dropped from the arguments, its text is content
    msg = P.parse(head + "<parameter=days>\n3", SCHEMAS)
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert msg.content == "<parameter=days>\n3"
    # a repeated parameter: the first value stands (it may already have been sent)
    assert calls(head + "<parameter=city>\nRome\n</parameter>\n</function>") == [
        ("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("tail", ["", "\n", "</function>", "</function>\n", "</function>\n</tool",
                                  "</func", "</tool_call>", "<"])
def test_a_call_cut_off_counts_when_no_parameter_is_open(tail: str) -> None:
    """A stop string (`</tool_call>`) or max_tokens can end the output anywhere after the
    last `</parameter>`; a cut-off end marker is dropped."""
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n" + tail
    msg = P.parse(text, SCHEMAS)
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("get_weather", '{"days": 3}')]
    assert msg.content is None


def test_a_call_after_a_missing_end_tag_still_counts() -> None:
    text = block("get_time", ("tz", "UTC")).removesuffix("</tool_call>") + block("get_time")
    assert calls(text) == [("get_time", '{"tz": "UTC"}'), ("get_time", "{}")]


def test_earlier_calls_are_written_back_and_read_as_the_same_calls() -> None:
    history = [
        {"id": "call_1", "function": {"name": "get_weather", "arguments": json.dumps({
            "city": "Paris\nFrance", "days": 3, "temp": 21.5, "metric": True, "opts": {"a": [1]},
            "tags": ["x"], "nothing": None, "when": None, "size": "large"})}},
        {"id": "call_2", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}},
        ToolCall(id="call_3", name="get_time", arguments="{}"),
    ]
    text = P.render_assistant("Checking.", history)
    assert text.startswith("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                           "Paris\nFrance\n</parameter>\n<parameter=days>\n3\n</parameter>\n")
    assert '<parameter=opts>\n{"a": [1]}\n</parameter>' in text
    assert text.endswith("<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
    parsed = P.parse(text, SCHEMAS)
    assert parsed.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", json.loads(history[0]["function"]["arguments"])),  # type: ignore[index]
        ("get_time", {"tz": "UTC"}), ("get_time", {})]
    assert P.render_tool_result("22 C", "get_weather") == "<tool_response>\n22 C\n</tool_response>"


def test_forced_calls_stop_strings_and_system_prompt() -> None:
    assert P.forced_prefix(None) == "<tool_call>\n"
    forced = P.forced_prefix("get_weather")
    assert forced == "<tool_call>\n<function=get_weather>\n"
    stream = P.stream(forced, SCHEMAS)  # the prefix alone emits nothing
    assert stream.feed("<parameter=days>\n").tool_calls[0].name == "get_weather"
    assert calls(forced + "<parameter=days>\n4\n</parameter>\n</function>") == [
        ("get_weather", '{"days": 4}')]
    assert P.stop_strings(parallel_tool_calls=False) == ["</tool_call>"] and P.stop_strings() == []
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMAS["get_weather"]}}]
    prompt = P.system_prompt(tools, "Be brief.")
    assert prompt.startswith("Be brief.\n\n# Tools\n") and '"name": "get_weather"' in prompt
    assert "<function=example_function_name>\n<parameter=example_parameter_1>" in prompt


QWEN3_CODER_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}"
    "{{- tool | tojson }}{%- endfor %}{{- '</tools>\\n<tool_call>\\n<function=example_function_name>"
    "\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}"
    "{%- endif %}{%- for message in messages %}{{ message.content }}{%- endfor %}"
)
# Llama 3.1's custom-tool prompt also writes `<function=`, with JSON arguments.
LLAMA_FUNCTION_TAGS = (
    "{%- if tools %}Given the following functions, reply as <function=example_function_name>"
    "{\"example_name\": \"example_value\"}</function>{%- endif %}"
)


def test_chosen_by_name_and_from_qwen3_coders_template() -> None:
    assert TOOL_PARSERS["qwen3_coder"] is Qwen3CoderToolParser
    assert isinstance(get_tool_parser("qwen3_coder"), Qwen3CoderToolParser)
    assert detect_tool_parser(QWEN3_CODER_TEMPLATE) == "qwen3_coder"
    assert detect_tool_parser(QWEN3_CODER_TEMPLATE.replace("<function=", "<fn=")) == "hermes"
    assert detect_tool_parser(LLAMA_FUNCTION_TAGS) == "llama3_json"
