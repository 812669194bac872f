"""Tool-call formats by name, and a guess of the right one from a model's chat template."""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

import jinja2
from jinja2 import meta

from tandem.server.tool_parsers.base import ToolParser
from tandem.server.tool_parsers.deepseek import (
    CALLS_BEGIN,
    SEP,
    DeepSeekV3ToolParser,
    DeepSeekV31ToolParser,
)
from tandem.server.tool_parsers.hermes import HermesToolParser
from tandem.server.tool_parsers.kimi_k2 import SECTION_BEGIN, KimiK2ToolParser
from tandem.server.tool_parsers.llama3_json import PYTHON_TAG, Llama3JsonToolParser
from tandem.server.tool_parsers.qwen3_coder import FUNCTION, PARAMETER, Qwen3CoderToolParser

TOOL_PARSERS: Mapping[str, type[ToolParser]] = MappingProxyType(
    {
        "hermes": HermesToolParser,
        "qwen": HermesToolParser,
        "llama3_json": Llama3JsonToolParser,
        "kimi_k2": KimiK2ToolParser,
        "deepseek_v3": DeepSeekV3ToolParser,
        "deepseek_v31": DeepSeekV31ToolParser,
        "qwen3_coder": Qwen3CoderToolParser,
    }
)

# Used when nothing in the template names a format: it is also the format tandem injects
# into templates without tool support, so the prompt and the parser always match.
DEFAULT_TOOL_PARSER = "hermes"

# Phrases only Llama 3.1 / 3.2 templates write when they teach JSON calls.
_LLAMA3_MARKERS = (PYTHON_TAG, "Given the following functions", "dictionary of argument name")

# What only DeepSeek-V3's calls have: the name after the sep (its template writes
# `tool['type'] + '<｜tool▁sep｜>' + name`, a template with the type spelled out writes
# `function<｜tool▁sep｜>`), and arguments in a ```json fence. V3.1 writes `name<｜tool▁sep｜>`.
_DEEPSEEK_V3_MARKERS = ("function" + SEP, "```json")

# Fallback for templates jinja2 cannot parse (unknown extension tags): `tools` used inside a
# `{{ }}` or `{% %}` block, not merely the word in the template's prose.
_TOOLS_IN_BLOCK = re.compile(r"\{[{%](?:(?![}%]\}).)*\btools\b", re.DOTALL)


def get_tool_parser(name: str) -> ToolParser:
    try:
        cls = TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; supported: {', '.join(sorted(TOOL_PARSERS))}"
        ) from None
    return cls()


def detect_tool_parser(chat_template: str | None) -> str:
    """The parser for the format a chat template teaches, for `--tool-parser auto`."""
    if not chat_template:
        return DEFAULT_TOOL_PARSER
    if SECTION_BEGIN in chat_template:
        return "kimi_k2"
    # Qwen3-Coder's calls sit in <tool_call> too, so this comes before Hermes. `<function=`
    # alone is not enough: Llama 3.1's custom-tool prompt writes `<function=NAME>{json}`.
    if FUNCTION in chat_template and PARAMETER in chat_template:
        return "qwen3_coder"
    if CALLS_BEGIN in chat_template:
        if any(marker in chat_template for marker in _DEEPSEEK_V3_MARKERS):
            return "deepseek_v3"
        return "deepseek_v31"
    if "<tool_call>" in chat_template:
        return "hermes"
    if any(marker in chat_template for marker in _LLAMA3_MARKERS):
        return "llama3_json"
    return DEFAULT_TOOL_PARSER


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the template reads the `tools` variable; if not, the server must describe the
    tools itself (`ToolParser.system_prompt`), or the model never learns of them."""
    if not chat_template:
        return False
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        ast = env.parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return _TOOLS_IN_BLOCK.search(chat_template) is not None
    return "tools" in meta.find_undeclared_variables(ast)
