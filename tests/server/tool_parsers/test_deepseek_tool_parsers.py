"""DeepSeek-V3 and V3.1 formats: what `parse` returns, how earlier calls are written back and
forced, the choice from a chat template, and the markers surviving detokenization as special
tokens (SmolLM2's tokenizer with DeepSeek's markers added as special tokens, as DeepSeek's own
vocabulary holds them)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.loader.tokenizer import Tokenizer
from tandem.server.tool_parsers import (
    DeepSeekV3ToolParser,
    DeepSeekV31ToolParser,
    ToolCall,
    ToolParser,
    detect_tool_parser,
    get_tool_parser,
    template_supports_tools,
)
from tandem.server.tool_parsers.deepseek import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
)
from tests.support.tokenizers import smollm_tokenizer_with

V3 = DeepSeekV3ToolParser()
V31 = DeepSeekV31ToolParser()


def v3_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def v31_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"


def section(*calls: str) -> str:
    return CALLS_BEGIN + "".join(calls) + CALLS_END


def calls_of(parser: ToolParser, text: str) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in parser.parse(text).tool_calls]


def test_v3_calls_after_text() -> None:
    text = "Let me look.\n" + section(v3_call("get_weather", '{"city": "Paris"}'),
                                      "\n" + v3_call("get_time", "{}"))
    msg = V3.parse(text)
    assert msg.content == "Let me look."
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert all(c.id.startswith("call_") for c in msg.tool_calls)
    assert len({c.id for c in msg.tool_calls}) == 2


def test_v31_calls_after_text() -> None:
    text = "Sure." + section(v31_call("get_weather", '{"city":"東京"}'), v31_call("get_time", ""))
    msg = V31.parse(text)
    assert msg.content == "Sure."
    # re-serialized, non-ASCII kept as is; no arguments at all means {}
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [
        ("get_weather", '{"city": "東京"}'), ("get_time", "{}")]


def test_text_only_and_text_after_the_calls() -> None:
    assert V31.parse("Just words.").content == "Just words."
    msg = V31.parse(section(v31_call("f", "{}")) + "\n\nDone.")
    assert (msg.content, [c.name for c in msg.tool_calls]) == ("Done.", ["f"])


@pytest.mark.parametrize(("parser", "text"), [
    (V3, section(v3_call("f", "{not json"))),
    (V3, section(v3_call("f", "[1]"))),  # arguments must be an object
    (V3, section(f"{CALL_BEGIN}{SEP}f\n```json\n{{}}\n```{CALL_END}")),  # no type
    (V3, section(v3_call("", "{}"))),  # no name
    (V3, section(v31_call("f", "{}"))),  # the other format
    (V31, section(v31_call("f", '{"a": '))),
    (V31, section(v31_call("f", '"text"'))),
    (V31, section(f"{CALL_BEGIN}f{{}}{CALL_END}")),  # no sep
    (V31, section(v31_call("two words", "{}"))),
    (V31, section(v3_call("f", "{}"))),  # the other format
])
def test_a_malformed_call_is_text_never_an_error(parser: ToolParser, text: str) -> None:
    msg = parser.parse(text)
    assert msg.tool_calls == [] and msg.content is not None and CALL_BEGIN in msg.content


def test_a_malformed_call_does_not_lose_its_neighbours() -> None:
    text = section(v31_call("a", "{}"), v31_call("b", "{bad"), v31_call("c", '{"x": 1}'))
    msg = V31.parse(text)
    assert [c.name for c in msg.tool_calls] == ["a", "c"]
    assert msg.content == v31_call("b", "{bad")


def test_a_call_cut_before_its_end_marker_counts_if_its_arguments_are_whole() -> None:
    full = CALLS_BEGIN + v3_call("f", '{"a": 1}')
    no_end = full.removesuffix(CALL_END)
    # cut inside the end marker, before it, inside the closing fence, before the fence
    for cut in (full[:-3], no_end, no_end[:-1], no_end[:-3], no_end[:-4]):
        assert calls_of(V3, cut) == [("f", {"a": 1})], cut
    assert calls_of(V31, CALLS_BEGIN + v31_call("f", '{"a": 1}')[:-3]) == [("f", {"a": 1})]
    assert V31.parse(CALLS_BEGIN + v31_call("f", '{"a": ')[: -len(CALL_END)]).tool_calls == []
    assert V3.parse(CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "f\n```json\n{").tool_calls == []


@pytest.mark.parametrize("parser", [V3, V31], ids=lambda p: p.name)
def test_earlier_calls_are_written_back_and_read_the_same(parser: ToolParser) -> None:
    calls = [
        {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}},
        ToolCall(id="call_3", name="search", arguments='{"q": "café"}'),
    ]
    text = parser.render_assistant("Checking.", calls)
    assert text.startswith("Checking." + CALLS_BEGIN) and text.endswith(CALLS_END)
    msg = parser.parse(text)
    assert msg.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"}), ("search", {"q": "café"})]
    assert parser.render_assistant("Just text.", []) == "Just text."
    assert parser.render_assistant(None, calls[:1]) == parser.render_tool_calls(calls[:1])


def test_each_format_is_written_as_its_template_writes_it() -> None:
    calls = [{"function": {"name": "a", "arguments": "{}"}}, {"function": {"name": "b", "arguments": '{"x": 1}'}}]
    assert V3.render_tool_calls(calls) == section(v3_call("a", "{}"), "\n" + v3_call("b", '{"x": 1}'))
    assert V31.render_tool_calls(calls) == section(v31_call("a", "{}"), v31_call("b", '{"x": 1}'))
    for parser in (V3, V31):
        assert parser.render_tool_result("22 C", "get_weather") == "<｜tool▁output▁begin｜>22 C<｜tool▁output▁end｜>"


def test_forced_calls_and_stop_strings() -> None:
    assert V3.forced_prefix(None) == V31.forced_prefix(None) == CALLS_BEGIN + CALL_BEGIN
    assert V3.forced_prefix("get_weather") == f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n"
    assert V31.forced_prefix("get_weather") == f"{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}"
    assert calls_of(V3, V3.forced_prefix("get_weather") + '{"city": "Oslo"}\n```' + CALL_END) == [
        ("get_weather", {"city": "Oslo"})]
    assert calls_of(V31, V31.forced_prefix("get_weather") + '{"city": "Oslo"}') == [  # cut by the stop string
        ("get_weather", {"city": "Oslo"})]
    for parser in (V3, V31):
        assert parser.stop_strings(parallel_tool_calls=False) == [CALL_END] and parser.stop_strings() == []
        prompt = parser.system_prompt([{"type": "function", "function": {"name": "get_weather"}}], "Be brief.")
        assert prompt.startswith("Be brief.\n\n") and "### get_weather" in prompt
        assert parser.forced_prefix(None) in prompt  # the format is shown


# Cut down from DeepSeek's own templates: V3 writes `tool['type']` before the sep and the
# arguments in a ```json fence; V3.1 writes the name before the sep and the arguments bare.
DEEPSEEK_V3_TEMPLATE = (
    "{%- for message in messages %}{%- if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{%- for tool in message['tool_calls'] %}{%- if loop.first %}"
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' "
    "+ tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' "
    "+ '```' + '<｜tool▁call▁end｜>'}}{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + "
    "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + "
    "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- else %}{{ message['content'] }}{%- endif %}"
    "{%- endfor %}"
)
DEEPSEEK_V3_SPELLED_TEMPLATE = (
    "{%- for tc in message.tool_calls -%}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ tc.function.name }}"
    "{{ '\\n' }}{{ tc.function.arguments }}<｜tool▁call▁end｜>{%- endfor -%}<｜tool▁calls▁begin｜>"
)
DEEPSEEK_V31_TEMPLATE = (
    "{%- for message in messages %}{%- if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{%- for tool in message['tool_calls'] %}{%- if loop.first %}{{message['content'] + "
    "'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + "
    "tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}{%- else %}{{'<｜tool▁call▁begin｜>' + "
    "tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}"
    "{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- elif message['role'] == 'tool' %}"
    "{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- else %}"
    "{{ message['content'] }}{%- endif %}{%- endfor %}"
)
DEEPSEEK_V31_JINJA_TEMPLATE = (
    "{%- for tc in message.tool_calls -%}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ tc.function.name }}"
    "<｜tool▁sep｜>{{ tc.function.arguments }}<｜tool▁call▁end｜><｜tool▁calls▁end｜>{%- endfor -%}"
)


def test_chosen_by_name_and_from_deepseeks_templates() -> None:
    assert isinstance(get_tool_parser("deepseek_v3"), DeepSeekV3ToolParser)
    assert isinstance(get_tool_parser("deepseek_v31"), DeepSeekV31ToolParser)
    assert detect_tool_parser(DEEPSEEK_V3_TEMPLATE) == "deepseek_v3"
    assert detect_tool_parser(DEEPSEEK_V3_SPELLED_TEMPLATE) == "deepseek_v3"
    assert detect_tool_parser(DEEPSEEK_V31_TEMPLATE) == "deepseek_v31"
    assert detect_tool_parser(DEEPSEEK_V31_JINJA_TEMPLATE) == "deepseek_v31"
    # DeepSeek's templates render earlier calls but declare no tools: tandem teaches them
    assert not template_supports_tools(DEEPSEEK_V31_TEMPLATE)


@pytest.fixture(scope="module")
def deepseek_like_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """SmolLM2's tokenizer with DeepSeek's five markers added as special tokens."""
    return smollm_tokenizer_with(tmp_path_factory.mktemp("deepseek-tokenizer"), DeepSeekV31ToolParser.preserved_tokens)


@pytest.mark.parametrize(("parser", "call"), [(V3, v3_call), (V31, v31_call)], ids=["v3", "v31"])
def test_the_markers_survive_detokenization_and_other_special_tokens_do_not(
    deepseek_like_tokenizer: Tokenizer, parser: ToolParser, call: Callable[[str, str], str]
) -> None:
    assert parser.preserved_tokens == (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
    tok = deepseek_like_tokenizer
    text = "Sure." + section(call("get_weather", '{"city": "Paris"}')) + "<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    preserved = [tok.convert_tokens_to_ids(m) for m in parser.preserved_tokens]
    assert all(i in ids for i in preserved)  # each marker is one token

    def detokenize(**kwargs: object) -> str:
        detok = IncrementalDetokenizer(tok, [], **kwargs)  # type: ignore[arg-type]
        return "".join(detok.add(i) for i in ids) + detok.flush()

    plain = detokenize()  # every special token skipped, as by default
    assert plain.startswith("Sure.") and CALLS_BEGIN not in plain and "<|im_end|>" not in plain
    kept = detokenize(preserved_token_ids=preserved)
    assert kept == text.removesuffix("<|im_end|>")  # the markers kept, <|im_end|> still skipped
    assert calls_of(parser, kept) == [("get_weather", {"city": "Paris"})]
    assert detokenize(skip_special_tokens=False, preserved_token_ids=preserved) == text
