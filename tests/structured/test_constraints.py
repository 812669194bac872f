"""The engine core's matchers (GrammarConstraints) on SmolLM2's real vocabulary: compiled off
the engine loop, caught up with output a request arrived with, masks that allow exactly the
grammar's next tokens (one row per sampled position, drafts included), drafts cut where the
grammar refuses them, tokens accepted, forced tokens found, failures reported once."""

from __future__ import annotations

import json
import time

import pytest

from tandem.loader.resolve import resolve_model
from tandem.loader.tokenizer import load_tokenizer
from tandem.structured.constraints import GrammarConstraints, TokenizerSource, mask_allows
from tandem.types import GuidedDecoding, Request, SamplingParams

SMOLLM = resolve_model("smollm2-135m").hf_dir
VOCAB = 49152
EOS = 2
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(SMOLLM)


@pytest.fixture(scope="module")
def constraints():
    made = GrammarConstraints(TokenizerSource(SMOLLM, VOCAB, [EOS]))
    yield made
    made.shutdown()


def _request(request_id: str, guided: GuidedDecoding | None, output: list[int] = ()) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(guided=guided, max_tokens=50), frozenset({EOS}),
                   output_token_ids=list(output))


def _ready(constraints: GrammarConstraints, request: Request) -> bool:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if constraints.ready(request):
            return True
        if constraints.wait_for_compile(0.05) is False:
            return constraints.ready(request)
    raise AssertionError("the grammar never compiled")


def _append(request: Request, tokens: list[int]) -> None:
    for token in tokens:
        request.append_output_token(token)


def test_free_requests_are_not_tracked(constraints: GrammarConstraints) -> None:
    request = _request("free", None)
    constraints.add(request)
    assert constraints.ready(request) and not constraints.is_constrained("free")
    assert constraints.masks([("free", [])]) is None


def test_masks_allow_the_grammar_and_forced_tokens_are_appended(constraints, tokenizer) -> None:
    request = _request("json", GuidedDecoding(json=json.dumps(SCHEMA)))
    constraints.add(request)
    assert _ready(constraints, request)
    rows = constraints.masks([("json", [])]).resolve()["json"]
    assert rows.shape == (1, (VOCAB + 31) // 32)
    # The object must open with `{"`: llguidance allows that one token, not `{` then `"`.
    brace = tokenizer.encode('{"', add_special_tokens=False)
    assert len(brace) == 1 and mask_allows(rows[0], brace[0])
    assert not mask_allows(rows[0], tokenizer.encode("{", add_special_tokens=False)[0])
    assert not mask_allows(rows[0], tokenizer.encode("x", add_special_tokens=False)[0])
    assert not mask_allows(rows[0], EOS)
    _append(request, brace)
    assert constraints.accept(request) is None
    forced = constraints.forced_tokens(request, 50)
    assert tokenizer.decode(forced).startswith('city": "')  # the key and its quote have no alternative
    assert constraints.forced_tokens(request, 2) == forced[:2]
    _append(request, forced)
    assert constraints.accept(request) is None
    rest = tokenizer.encode('Rome", "days": 3}', add_special_tokens=False)
    _append(request, rest)
    verdict = constraints.accept(request)
    assert verdict is None or verdict == "stop"
    rows = constraints.masks([("json", [])]).resolve()["json"]
    assert mask_allows(rows[0], EOS)  # the object may end the output here
    constraints.forget("json")
    assert not constraints.is_constrained("json")


def test_drafts_are_cut_where_the_grammar_refuses_and_each_gets_a_row(constraints, tokenizer) -> None:
    request = _request("drafts", GuidedDecoding(regex="[0-9]+ apples"))
    constraints.add(request)
    assert _ready(constraints, request)
    digits = tokenizer.encode("12", add_special_tokens=False)
    word = tokenizer.encode(" pears", add_special_tokens=False)
    drafts = digits + word
    kept = constraints.valid_drafts(request, drafts)
    assert kept == digits
    rows = constraints.masks([("drafts", kept)]).resolve()["drafts"]
    assert rows.shape[0] == len(kept) + 1
    assert mask_allows(rows[-1], tokenizer.encode(" apples", add_special_tokens=False)[0])
    assert not mask_allows(rows[0], word[0])
    # Rows for drafts leave the matcher where it was: the request's own next mask is row 0's.
    again = constraints.masks([("drafts", [])]).resolve()["drafts"]
    assert (again[0] == rows[0]).all()


def test_a_request_arriving_with_output_continues_its_grammar(constraints, tokenizer) -> None:
    handed = tokenizer.encode("4", add_special_tokens=False)  # a prefill worker's first token
    request = _request("handed", GuidedDecoding(regex="[0-9]{2}"), handed)
    constraints.add(request)
    assert _ready(constraints, request)
    rows = constraints.masks([("handed", [])]).resolve()["handed"]
    assert mask_allows(rows[0], tokenizer.encode("2", add_special_tokens=False)[0])
    assert not mask_allows(rows[0], EOS)  # one digit is not enough: the handed token counted
    _append(request, tokenizer.encode("2", add_special_tokens=False))
    assert constraints.accept(request) == "stop"  # two digits: nothing else may follow


def test_output_that_breaks_the_grammar_is_reported(constraints, tokenizer) -> None:
    bad = _request("bad-handoff", GuidedDecoding(regex="[0-9]+"), tokenizer.encode("x", add_special_tokens=False))
    constraints.add(bad)
    assert not _ready(constraints, bad)
    failures = dict(constraints.failures())
    assert "does not match its grammar" in failures["bad-handoff"]
    assert "bad-handoff" not in dict(constraints.failures())  # reported once
    refused = _request("refused-token", GuidedDecoding(regex="[0-9]+"))
    constraints.add(refused)
    assert _ready(constraints, refused)
    _append(refused, tokenizer.encode("x", add_special_tokens=False))
    verdict = constraints.accept(refused)
    assert verdict is not None and verdict != "stop"


def test_a_grammar_only_the_vocabulary_refuses_fails_in_the_engine(constraints) -> None:
    request = _request("unknown-token", GuidedDecoding(grammar="start: <[999999]>"))
    constraints.add(request)
    assert not _ready(constraints, request)
    (request_id, why), = constraints.failures()
    assert request_id == "unknown-token" and why
    assert constraints.stats.compile_errors >= 1
