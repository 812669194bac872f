"""Kimi-K2 format: what `parse` returns (ids kept as `functions.NAME:IDX`), how earlier calls
are written back, the choice from a chat template, and the markers surviving detokenization
as special tokens (SmolLM2's tokenizer with Kimi's markers added as special tokens, as Kimi's
own vocabulary holds them)."""

from __future__ import annotations

import json

import pytest

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.loader.resolve import resolve_model
from tandem.loader.tokenizer import Tokenizer
from tandem.server.tool_parsers import (
    KimiK2ToolParser,
    ToolCall,
    detect_tool_parser,
    get_tool_parser,
)
from tandem.server.tool_parsers.kimi_k2 import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
)
from tests.support.tokenizers import smollm_tokenizer_with

P = KimiK2ToolParser()


def call(header: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{header}{ARGUMENT_BEGIN}{arguments}{CALL_END}"


def section(*calls: str) -> str:
    return SECTION_BEGIN + "".join(calls) + SECTION_END


def test_calls_keep_the_models_ids() -> None:
    text = "Let me look.\n" + section(call("functions.get_weather:3", '{"city": "Paris"}'),
                                      call("functions.get_time:4", "{}"))
    msg = P.parse(text)
    assert msg.content == "Let me look."
    assert [(c.id, c.name, json.loads(c.arguments)) for c in msg.tool_calls] == [
        ("functions.get_weather:3", "get_weather", {"city": "Paris"}),
        ("functions.get_time:4", "get_time", {}),
    ]


def test_a_header_without_functions_prefix_gets_it() -> None:
    [parsed] = P.parse(section(call(" search.web:0 ", '{"q": "x"}'))).tool_calls
    assert (parsed.id, parsed.name) == ("functions.search.web:0", "search.web")


@pytest.mark.parametrize("text", [
    section(call("functions.f:0", "{not json")),
    section(call("functions.f", "{}")),  # no index
    section(call("functions.f:0", "[1]")),  # arguments must be an object
    section(f"{CALL_BEGIN}functions.f:0{{}}{CALL_END}"),  # no argument marker
])
def test_a_malformed_call_is_text_never_an_error(text: str) -> None:
    msg = P.parse(text)
    assert msg.tool_calls == [] and msg.content is not None and CALL_BEGIN in msg.content


def test_a_call_cut_before_its_end_marker_counts_if_its_arguments_are_whole() -> None:
    cut = SECTION_BEGIN + call("functions.f:0", '{"a": 1}')[: -len(CALL_END) + 3]
    assert [c.name for c in P.parse(cut).tool_calls] == ["f"]
    assert P.parse(SECTION_BEGIN + CALL_BEGIN + 'functions.f:0' + ARGUMENT_BEGIN + '{"a": ').tool_calls == []


def test_earlier_calls_are_written_back_with_kimi_ids() -> None:
    calls = [
        {"id": "functions.get_weather:0", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_abc", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}},
        ToolCall(id="functions.search:7", name="search", arguments="{}"),
    ]
    text = P.render_assistant("Checking.", calls)
    assert text == ("Checking." + SECTION_BEGIN
                    + call("functions.get_weather:0", '{"city": "Paris"}')
                    + call("functions.get_time:1", '{"tz": "UTC"}')
                    + call("functions.search:7", "{}") + SECTION_END)
    # ... and read back as the same calls
    assert [(c.id, c.name) for c in P.parse(text).tool_calls] == [
        ("functions.get_weather:0", "get_weather"), ("functions.get_time:1", "get_time"), ("functions.search:7", "search")]
    assert P.render_assistant("Just text.", []) == "Just text."


def test_forced_calls_and_stop_strings() -> None:
    assert P.forced_prefix(None) == SECTION_BEGIN + CALL_BEGIN
    forced = P.forced_prefix("get_weather")
    assert [c.id for c in P.parse(forced + '{"city": "Oslo"}' + CALL_END).tool_calls] == ["functions.get_weather:0"]
    assert P.stop_strings(parallel_tool_calls=False) == [CALL_END] and P.stop_strings() == []
    assert "get_weather" in P.system_prompt([{"type": "function", "function": {"name": "get_weather"}}], "Be brief.")
    assert P.render_tool_result("22 C", "functions.get_weather:0") == "## Return of functions.get_weather:0\n22 C"


KIMI_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}{%- if message.tool_calls -%}<|tool_calls_section_begin|>"
    "{%- for tc in message.tool_calls -%}<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>"
    "{{ tc.function.arguments }}<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>"
    "{%- else -%}{{ message.content }}{%- endif -%}{%- endfor -%}"
)


def test_chosen_by_name_and_from_kimis_template() -> None:
    assert isinstance(get_tool_parser("kimi_k2"), KimiK2ToolParser)
    assert detect_tool_parser(KIMI_TEMPLATE) == "kimi_k2"


def test_the_flag_offers_every_parser() -> None:
    from tandem.flags.engine import SERVER_FLAGS
    from tandem.server.tool_parsers import TOOL_PARSERS

    [flag] = [f for f in SERVER_FLAGS.flags if f.option == "--tool-call-parser"]
    assert set(flag.choices or ()) == set(TOOL_PARSERS)


@pytest.fixture(scope="module")
def kimi_like_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """SmolLM2's tokenizer with Kimi's five markers added as special tokens."""
    return smollm_tokenizer_with(tmp_path_factory.mktemp("kimi-tokenizer"), KimiK2ToolParser.preserved_tokens)


def test_the_markers_survive_detokenization_and_other_special_tokens_do_not(kimi_like_tokenizer: Tokenizer) -> None:
    tok = kimi_like_tokenizer
    text = "Sure." + section(call("functions.get_weather:0", '{"city": "Paris"}')) + "<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    preserved = [tok.convert_tokens_to_ids(m) for m in KimiK2ToolParser.preserved_tokens]
    assert all(i in ids for i in preserved[:3] + preserved[4:])  # each marker is one token

    def detokenize(**kwargs: object) -> str:
        detok = IncrementalDetokenizer(tok, [], **kwargs)  # type: ignore[arg-type]
        return "".join(detok.add(i) for i in ids) + detok.flush()

    plain = detokenize()  # every special token skipped, as by default
    assert plain.startswith("Sure.") and SECTION_BEGIN not in plain and "<|im_end|>" not in plain
    kept = detokenize(preserved_token_ids=preserved)
    assert kept == text.removesuffix("<|im_end|>")  # the markers kept, <|im_end|> still skipped
    assert [c.id for c in P.parse(kept).tool_calls] == ["functions.get_weather:0"]
    assert detokenize(skip_special_tokens=False, preserved_token_ids=preserved) == text


def test_the_server_preserves_the_parsers_markers_that_are_tokens(kimi_like_tokenizer: Tokenizer) -> None:
    """What prepare_chat puts in a tool request's sampling params: the ids of the markers the
    vocabulary holds as added tokens, none for a parser without markers or a vocabulary
    without them."""
    from types import SimpleNamespace

    from tandem.server.serving import ServingState
    from tandem.server.tool_parsers import HermesToolParser

    def preserved(parser: object, tokenizer: object) -> list[int]:
        return ServingState.preserved_token_ids(SimpleNamespace(tool_parser=parser, tokenizer=tokenizer))  # type: ignore[arg-type]

    ids = preserved(P, kimi_like_tokenizer)
    assert [kimi_like_tokenizer.convert_ids_to_tokens(i) for i in ids] == list(KimiK2ToolParser.preserved_tokens)
    assert preserved(HermesToolParser(), kimi_like_tokenizer) == []
    smollm = Tokenizer.from_directory(resolve_model("smollm2-135m").hf_dir)
    assert preserved(P, smollm) == []
