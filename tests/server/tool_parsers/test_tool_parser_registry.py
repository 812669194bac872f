"""Parser lookup by name and the guess from a chat template."""

from __future__ import annotations

import pytest

from tandem.server.tool_parsers import (
    DEFAULT_TOOL_PARSER,
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    detect_tool_parser,
    get_tool_parser,
    template_supports_tools,
)

QWEN25 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for tool in tools %}{{- tool | tojson }}"
    "{%- endfor %}{{- '<tool_call>\\n{\"name\": <function-name>}\\n</tool_call>' }}{%- endif %}"
    "{%- for message in messages %}{{ message.content }}{%- endfor %}"
)
LLAMA31 = (
    "{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}"
    "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    "{%- if tools is not none %}Given the following functions, please respond with a JSON"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{%- endfor %}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'ipython' %}<|python_tag|>{%- endif %}"
    "{{ message.content }}{%- endfor %}"
)
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant; no tools<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}"
)


def test_names_map_to_parsers() -> None:
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    assert isinstance(get_tool_parser("qwen"), HermesToolParser)
    assert isinstance(get_tool_parser("llama3_json"), Llama3JsonToolParser)
    for name, cls in TOOL_PARSERS.items():
        assert cls.name in TOOL_PARSERS
        assert isinstance(get_tool_parser(name), cls)


def test_unknown_name_lists_supported() -> None:
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'") as err:
        get_tool_parser("mistral")
    assert "hermes" in str(err.value) and "llama3_json" in str(err.value)


def test_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        TOOL_PARSERS["x"] = HermesToolParser  # type: ignore[index]


def test_detect_from_template() -> None:
    assert detect_tool_parser(QWEN25) == "hermes"
    assert detect_tool_parser(LLAMA31) == "llama3_json"
    assert detect_tool_parser(SMOLLM2) == DEFAULT_TOOL_PARSER == "hermes"
    assert detect_tool_parser(None) == "hermes"
    assert detect_tool_parser("") == "hermes"


def test_template_supports_tools() -> None:
    assert template_supports_tools(QWEN25)
    assert template_supports_tools(LLAMA31)
    assert not template_supports_tools(SMOLLM2)  # says "tools" only in its prose
    assert not template_supports_tools(None)


def test_template_with_unknown_tags_falls_back_to_a_scan() -> None:
    with_tools = "{% generation %}{{ tools | length }}{% endgeneration %}"
    without = "{% generation %}I have no tools.{% endgeneration %}"
    assert template_supports_tools(with_tools)
    assert not template_supports_tools(without)
