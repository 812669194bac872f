"""Every way a client asks for structured output becomes a grammar llguidance compiles, and
every bad one is a GrammarError whose message names the problem (the API turns it into a 400)."""

from __future__ import annotations

import json

import llguidance
import pytest

from tandem.structured.grammar import MAX_GRAMMAR_CHARS, GrammarError, grammar_text
from tandem.types import GuidedDecoding
from tests.support.tokenizers import smollm_llg_tokenizer

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


def _accepts(guided: GuidedDecoding, text: str) -> bool:
    """Whether the compiled grammar takes `text` whole (and may end there)."""
    tokenizer = smollm_llg_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(guided))
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.parametrize(("guided", "good", "bad"), [
    (GuidedDecoding(json=json.dumps(SCHEMA)), '{"n": 7}', '{"n": 12}'),
    (GuidedDecoding(json_object=True), '{"a": [1, 2]}', "[1, 2]"),
    (GuidedDecoding(regex=r"[0-9]{3}-[a-z]{2}"), "123-ab", "12-ab"),
    (GuidedDecoding(choice=("yes", "no")), "no", "maybe"),
    (GuidedDecoding(grammar='start: "a" B\nB: /[0-9]+/'), "a42", "b42"),
    (GuidedDecoding(grammar='root ::= "a" [0-9]+', grammar_syntax="ebnf"), "a42", "a"),
    (GuidedDecoding(json_object=True, starts_after="</think>"), 'free {thinking}</think>{"a": 1}', '{"a": 1}'),
])
def test_each_kind_takes_what_it_describes_and_no_more(guided: GuidedDecoding, good: str, bad: str) -> None:
    assert _accepts(guided, good)
    assert not _accepts(guided, bad)


@pytest.mark.parametrize(("guided", "says"), [
    (GuidedDecoding(json="{"), "not valid JSON"),
    (GuidedDecoding(json=json.dumps({"type": "strin"})), "strin"),
    (GuidedDecoding(json="3"), "must be an object"),
    (GuidedDecoding(regex="(("), "regex"),
    (GuidedDecoding(grammar="start: missing_rule"), "missing_rule"),
    (GuidedDecoding(grammar="root ::= nowhere", grammar_syntax="ebnf"), "nowhere"),
    (GuidedDecoding(grammar="start: x", grammar_syntax="yacc"), "lark"),
    (GuidedDecoding(choice=()), "choice"),
    (GuidedDecoding(regex="a" * (MAX_GRAMMAR_CHARS + 1)), "at most"),
])
def test_a_bad_constraint_is_refused_with_a_reason(guided: GuidedDecoding, says: str) -> None:
    with pytest.raises(GrammarError, match=None) as caught:
        grammar_text(guided)
    assert says in str(caught.value)


def test_exactly_one_kind() -> None:
    with pytest.raises(GrammarError, match="exactly one"):
        grammar_text(GuidedDecoding(regex="a", choice=("a",)))
    with pytest.raises(ValueError, match="exactly one"):
        from tandem.types import SamplingParams
        SamplingParams(guided=GuidedDecoding())
