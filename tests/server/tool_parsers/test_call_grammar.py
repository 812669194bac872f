"""Tool-call grammars (tool_parsers/grammar.py) on real vocabularies: in each format, the calls
its own renderer writes are accepted and parse back to the same names and arguments; a call of
an undeclared tool, arguments that break the schema, or text where only calls may come are
refused; under "auto" free text is accepted alone or before calls.

Formats whose markers are special tokens (Kimi-K2, DeepSeek, Qwen's `<tool_call>`) are tested
on SmolLM2's vocabulary with those tokens added, as their own tokenizers hold them."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest

from tandem.server.tool_parsers.grammar import tool_call_grammar
from tandem.server.tool_parsers.registry import TOOL_PARSERS
from tests.support.tokenizers import smollm_tokenizer_with

TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                    "required": ["city", "unit"], "additionalProperties": False},
    "add": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}, "b": {"type": "integer"}},
            "required": ["a", "b"]},
}
CALLS = [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 2, "b": 3})]
HERMES_MARKERS = ("<tool_call>", "</tool_call>")
FORMATS = ["hermes", "llama3_json", "kimi_k2", "deepseek_v3", "deepseek_v31", "qwen3_coder"]


@pytest.fixture(scope="module", params=FORMATS)
def dialect(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    parser = TOOL_PARSERS[request.param]()
    markers = parser.preserved_tokens or (HERMES_MARKERS if request.param in ("hermes", "qwen3_coder") else ())
    tokenizer = smollm_tokenizer_with(tmp_path_factory.mktemp(request.param), markers)
    llg = llguidance.LLTokenizer(tokenizer.backend_tokenizer.to_str())
    return parser, tokenizer, llg


def _render(parser, calls) -> str:
    return parser.render_tool_calls([{"id": f"functions.{name}:{i}", "type": "function",
                                      "function": {"name": name, "arguments": json.dumps(args)}}
                                     for i, (name, args) in enumerate(calls)])


def _takes(dialect, text: str, *, required: bool, tools=TOOLS, parallel: bool = True) -> bool:
    parser, tokenizer, llg = dialect
    grammar = tool_call_grammar(parser, tools, tokenizer.added_tokens_encoder, required=required, parallel=parallel)
    assert grammar is not None
    matcher = llguidance.LLMatcher(llg, grammar)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_rendered_calls_are_accepted_and_parse_back(dialect) -> None:
    parser = dialect[0]
    for calls in (CALLS[:1], CALLS):
        text = _render(parser, calls)
        assert _takes(dialect, text, required=True), text
        parsed = parser.parse(text, TOOLS)
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls


def test_what_is_not_a_valid_call_is_refused(dialect) -> None:
    parser = dialect[0]
    assert not _takes(dialect, _render(parser, [("delete_everything", {"city": "Paris", "unit": "c"})]), required=True)
    assert not _takes(dialect, _render(parser, [("get_weather", {"city": "Paris", "unit": "kelvin"})]), required=True)
    assert not _takes(dialect, _render(parser, [("add", {"a": -1, "b": 3})]), required=True)
    assert not _takes(dialect, _render(parser, [("add", {"a": 1})]), required=True)
    assert not _takes(dialect, "I think the weather is nice.", required=True)
    assert not _takes(dialect, _render(parser, CALLS), required=True, parallel=False)


def test_auto_takes_text_alone_or_before_calls_where_a_special_token_opens_them(dialect) -> None:
    parser, tokenizer, _ = dialect
    grammar = tool_call_grammar(parser, TOOLS, tokenizer.added_tokens_encoder, required=False)
    if parser.name == "llama3_json":
        assert grammar is None  # a call opens with plain text: nothing tells it from an answer
        return
    assert _takes(dialect, "Just an answer.", required=False)
    separator = "\n" if parser.name in ("hermes", "qwen3_coder") else ""
    assert _takes(dialect, "Let me check." + separator + _render(parser, CALLS[:1]), required=False)
    assert not _takes(dialect, "Let me check." + separator + _render(parser, [("nope", {})]), required=False)
    # A call written some other way (bare JSON, a fence) is not free text: where the parser
    # reads bare calls (Hermes) they are checked like enveloped ones, elsewhere refused.
    bare = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    reads_bare = parser.call_shape().bare
    assert reads_bare == (parser.name == "hermes")  # Hermes' parser reads bare calls (hermes.py)
    assert _takes(dialect, bare, required=False) == reads_bare
    assert _takes(dialect, f"```json\n{bare}\n```", required=False) == reads_bare
    if reads_bare:
        for text in (bare, f"```json\n{bare}\n```"):
            assert [c.name for c in parser.parse(text, TOOLS).tool_calls] == ["add"]
    for disguised in ('{"name": "nope", "arguments": {}}', '{"name": "add", "arguments": {"a": -1, "b": 2}}',
                      '```json\n{"a": 1}\n```', " [1, 2]"):
        assert not _takes(dialect, disguised, required=False)


def test_a_keyword_the_grammar_cannot_enforce_is_left_unchecked(dialect) -> None:
    tools = {"tag": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                               "uniqueItems": True}}, "required": ["tags"]}}
    assert _takes(dialect, _render(dialect[0], [("tag", {"tags": ["a", "b"]})]), required=True, tools=tools)


def _qwen3_coder(tmp_path: Path):
    parser = TOOL_PARSERS["qwen3_coder"]()
    tokenizer = smollm_tokenizer_with(tmp_path, HERMES_MARKERS)
    return parser, tokenizer, llguidance.LLTokenizer(tokenizer.backend_tokenizer.to_str())


def test_qwen3_coder_values_are_raw_text_up_to_the_first_closing_tag(tmp_path: Path) -> None:
    """A string value is raw text (several lines, quotes, markup) but cannot hold
    `</parameter>`, where the parser would end it; optional parameters may be left out, in
    the schema's order; a schema without properties takes any parameter names."""
    dialect = _qwen3_coder(tmp_path)
    tools = {"write": {"type": "object", "properties": {"path": {"type": "string"}, "body": {"type": "string"},
                                                        "mode": {"type": "integer"}}, "required": ["path", "body"]},
             "anything": {"type": "object"}}
    body = 'def f():\n    return "<b>x</b>"\n'
    for calls in ([("write", {"path": "a.py", "body": body})], [("write", {"path": "a.py", "body": body, "mode": 644})],
                  [("anything", {"x": "1", "y": "two"})]):
        text = _render(dialect[0], calls)
        assert _takes(dialect, text, required=True, tools=tools), text
        parsed = dialect[0].parse(text, tools)
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    broken = _render(dialect[0], [("write", {"path": "a.py", "body": "x</parameter>y"})])
    assert not _takes(dialect, broken, required=True, tools=tools)
    out_of_order = _render(dialect[0], [("write", {"body": "b", "path": "a.py"})])
    assert not _takes(dialect, out_of_order, required=True, tools=tools)
    not_a_number = _render(dialect[0], [("write", {"path": "a.py", "body": "b", "mode": "rw"})])
    assert not _takes(dialect, not_a_number, required=True, tools=tools)
