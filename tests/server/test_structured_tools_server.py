"""Tool calls generated under a grammar, on Qwen2.5-Coder-0.5B (hermes calls; its template knows
tools) in a server of this module's own: `tool_choice` "required", a named function, and "auto"
with tools declared `strict: true`. Every call must name a declared tool and its arguments must
validate against that tool's schema, whatever the prompt asks (a unit outside the enum, a
quantity over the maximum, a question that needs no tool); the Anthropic Messages endpoint's
`tool_choice: any` and the Responses endpoint's `text.format` ride on the same constraints.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tandem.loader.resolve import default_cache_dir
from tests.support.live_server import LiveServer, start_server, stop_server

TOOL_MODEL = "qwen2.5-coder-0.5b"
TOOL_GGUF = default_cache_dir() / "models" / f"{TOOL_MODEL}.gguf"

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 30},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ALARM = {"type": "object",
         "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                        "minute": {"type": "integer", "minimum": 0, "maximum": 59}},
         "required": ["hour", "minute"], "additionalProperties": False}
ORDER = {"type": "object",
         "properties": {
             "items": {"type": "array", "minItems": 1, "maxItems": 3,
                       "items": {"type": "object",
                                 "properties": {"sku": {"type": "string", "maxLength": 12},
                                                "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
                                 "required": ["sku", "quantity"], "additionalProperties": False}},
             "shipping": {"type": "object",
                          "properties": {"express": {"type": "boolean"},
                                         "country": {"type": "string", "enum": ["FR", "DE", "JP", "US"]}},
                          "required": ["express", "country"], "additionalProperties": False}},
         "required": ["items", "shipping"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM, "place_order": ORDER}
DESCRIPTIONS = {"get_weather": "Get the current weather for a city", "set_alarm": "Set an alarm clock",
                "place_order": "Order items from the shop"}


def _tools(strict: bool | None = None) -> list[dict[str, Any]]:
    tools = []
    for name, schema in SCHEMAS.items():
        function: dict[str, Any] = {"name": name, "description": DESCRIPTIONS[name], "parameters": schema}
        if strict is not None:
            function["strict"] = strict
        tools.append({"type": "function", "function": function})
    return tools


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    assert TOOL_GGUF.is_file(), f"{TOOL_GGUF} is missing: run scripts/setup.sh (it assembles {TOOL_MODEL})"
    server = start_server(tmp_path_factory.mktemp("qwen-structured") / "serve.log", TOOL_MODEL,
                          "--kv-cache-memory", "512MiB", "--max-num-seqs", "4", "--threads", "1")
    yield server
    assert not stop_server(server)


@pytest.fixture(scope="module")
def client(tool_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _ask(content: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def _valid_calls(calls: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each call, each checked: a declared tool, arguments that validate."""
    checked = []
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in SCHEMAS, call
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        checked.append((call.function.name, arguments))
    return checked


# What each prompt asks for is partly outside the schemas (kelvin, twelve of an item, 25 o'clock)
# or needs no tool at all: the calls must validate regardless.
PROMPTS = ["What is the weather in Oslo, in kelvin?", "Wake me up at 25:70, please.",
           "Order twelve apples, shipped express to Japan.", "Tell me a joke."]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_required_calls_name_declared_tools_and_validate(client: openai.OpenAI, prompt: str) -> None:
    reply = client.chat.completions.create(model=TOOL_MODEL, messages=_ask(prompt), tools=_tools(),
                                           tool_choice="required", temperature=0, max_tokens=80)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    assert _valid_calls(choice.message.tool_calls or [])


def test_named_function_is_exactly_one_call_of_it(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=TOOL_MODEL, messages=_ask("What is the weather in Paris?"), tools=_tools(), temperature=0,
        max_tokens=40, tool_choice={"type": "function", "function": {"name": "set_alarm"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [name for name, _ in _valid_calls(choice.message.tool_calls or [])] == ["set_alarm"]


def test_auto_with_strict_tools_calls_validate(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=TOOL_MODEL, messages=_ask(PROMPTS[1]), tools=_tools(strict=True),
                                           tool_choice="auto", temperature=0, max_tokens=40)
    message = reply.choices[0].message
    # Free text stays free, but not a call written outside the envelope (bare JSON, a fence):
    # a call is either in the envelope, under its schema, or not made.
    _valid_calls(message.tool_calls or [])
    assert not (message.content or "").lstrip().startswith(("{", "[", "`")), message.content


def test_streamed_call_deltas_are_the_whole_calls(client: openai.OpenAI) -> None:
    ask = {"model": TOOL_MODEL, "messages": _ask("Wake me up at 25:70, please."), "tools": _tools(),
           "tool_choice": "required", "temperature": 0, "max_tokens": 40}
    whole = client.chat.completions.create(**ask)
    expected = [(call.function.name, call.function.arguments) for call in whole.choices[0].message.tool_calls or []]
    assert expected and _valid_calls(whole.choices[0].message.tool_calls)
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                if delta.function and delta.function.name:
                    names[delta.index] = names.get(delta.index, "") + delta.function.name
                if delta.function and delta.function.arguments:
                    arguments[delta.index] = arguments.get(delta.index, "") + delta.function.arguments
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [(names[i], arguments.get(i, "")) for i in sorted(names)] == expected


def test_anthropic_tool_choice_any(tool_server: LiveServer) -> None:
    client = anthropic.Anthropic(base_url=tool_server.url, api_key="unused", max_retries=0, timeout=300)
    tools = [{"name": name, "description": DESCRIPTIONS[name], "input_schema": schema}
             for name, schema in SCHEMAS.items()]
    # The SDK has no temperature (newer Claude models take none): greedy through extra_body.
    message = client.messages.create(model=TOOL_MODEL, max_tokens=60, messages=_ask("Wake me up at 25:70, please."),
                                      tools=tools, tool_choice={"type": "any"}, extra_body={"temperature": 0})
    assert message.stop_reason == "tool_use", message
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and not [block for block in message.content if block.type == "text" and block.text.strip()]
    for use in uses:
        assert use.name in SCHEMAS
        jsonschema.validate(use.input, SCHEMAS[use.name])


def test_responses_text_format_json_schema(client: openai.OpenAI) -> None:
    city = {"type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
                           "landmarks": {"type": "array", "maxItems": 2,
                                         "items": {"type": "string", "enum": ["tower", "bridge", "museum"]}}},
            "required": ["city", "population_millions", "landmarks"], "additionalProperties": False}
    response = client.responses.create(model=TOOL_MODEL, input="Describe Paris.", temperature=0,
                                       max_output_tokens=60, store=False,
                                       text={"format": {"type": "json_schema", "name": "city", "schema": city,
                                                        "strict": True}})
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), city)
