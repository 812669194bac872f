"""A request's constraint as an llguidance grammar, and the check the edge runs on it.

llguidance (github.com/guidance-ai/llguidance) compiles JSON schemas, regular expressions and
Lark grammars into a token-level matcher whose mask costs tens of microseconds per step on a
150k vocabulary and needs neither torch nor a GPU (docs/serving.md, "Structured outputs", says
why it was chosen over xgrammar). Everything a client sends goes through `grammar_text`,
which raises `GrammarError` naming the problem; the API layer turns that into a 400.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from tandem.types import GuidedDecoding

# A schema or grammar larger than this is refused before compiling (a client's text reaches a
# compiler: bound the work it can ask for).
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024

# JSON output as models write it: ", " and ": " between items, no free whitespace (a model
# allowed free whitespace can pad forever).
_JSON_OPTIONS: dict[str, Any] = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message says why, for the client."""


def grammar_text(guided: GuidedDecoding) -> str:
    """The llguidance grammar for `guided`, validated (GrammarError otherwise). Cached: an
    agent sends the same tool schemas every turn."""
    return _grammar_text(guided)


@lru_cache(maxsize=256)
def _grammar_text(guided: GuidedDecoding) -> str:
    kinds = guided.kinds()
    if len(kinds) != 1:
        raise GrammarError(f"exactly one constraint is needed, got {', '.join(kinds) or 'none'}")
    grammar = _body_grammar(guided)
    if guided.starts_after:
        grammar = _after_free_text(grammar, guided.starts_after)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(_clean(messages[0] if messages else "the grammar does not compile"))
    return grammar


def _body_grammar(guided: GuidedDecoding) -> str:
    if guided.json is not None:
        _check_size(guided.json, "the JSON schema")
        try:
            schema = json.loads(guided.json)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("a JSON schema must be an object (or true/false)")
        return _from_schema(schema)
    if guided.json_object:
        return _from_schema({"type": "object"})
    if guided.regex is not None:
        _check_size(guided.regex, "the regex")
        return llguidance.LLMatcher.grammar_from_regex(guided.regex)
    if guided.choice is not None:
        choices = list(guided.choice)
        if not choices or len(choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError(f"choice must be 1 to {MAX_CHOICES} non-empty strings")
        _check_size("".join(choices), "the choices")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    assert guided.grammar is not None
    _check_size(guided.grammar, "the grammar")
    if guided.grammar_syntax == "ebnf":
        try:
            lark = gbnf_to_lark(guided.grammar)
        except Exception as exc:  # the converter raises its own errors on bad GBNF
            raise GrammarError(f"the EBNF grammar does not parse: {exc}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    if guided.grammar_syntax != "lark":
        raise GrammarError(f"grammar syntax must be 'lark' or 'ebnf', got {guided.grammar_syntax!r}")
    return llguidance.LLMatcher.grammar_from_lark(guided.grammar)


def _from_schema(schema: dict | bool) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(f"the JSON schema cannot be used: {exc}") from None


def _after_free_text(grammar: str, marker: str) -> str:
    """`grammar` behind free text that ends at the first `marker` (a reasoning block: the
    model thinks freely, then answers under the constraint)."""
    if grammar.lstrip().startswith("{"):
        entries = json.loads(grammar)["grammars"]
    else:
        entries = [{"lark_grammar": grammar}]
    body = [{**entries[0], "name": "constrained_body"}, *entries[1:]]
    free = ("%llguidance {}\n"
            "start: free_text @constrained_body\n"
            f"free_text[lazy]: /(?s:.*)/ {json.dumps(marker)}\n")
    return json.dumps({"grammars": [{"lark_grammar": free}, *body]})


def _check_size(text: str, what: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{what} is {len(text)} characters; at most {MAX_GRAMMAR_CHARS} are accepted")


def _clean(message: str) -> str:
    return message.strip().removeprefix("ERROR: ").strip()
