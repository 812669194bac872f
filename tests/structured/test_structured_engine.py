"""Constrained decoding end to end on the default model (SmolLM2-135M, offline `LLM`).

Property tests: for random JSON schemas (nested objects, enums, arrays with bounds, anyOf,
string formats and patterns, integer ranges), every output validates (`jsonschema`, formats
checked), greedy and sampled, with and without speculative decoding, with and without
jump-forward; greedy output with drafts is token for token the output without them. In a
batch, a free request's output is what it is alone (no mask reaches it) and n > 1 samples each
follow their own matcher. A request that arrives with part of its output (a decode worker's,
a migrated stream's) resumes its grammar and ends with the uninterrupted greedy output. A
tool-call grammar makes even this model, which was never taught a
call format, write a call its format's parser reads back as valid.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem import LLM
from tandem.engine.engine_core import EngineCoreRequest
from tandem.server.tool_parsers.grammar import tool_call_grammar
from tandem.server.tool_parsers.registry import TOOL_PARSERS
from tandem.types import GuidedDecoding, SamplingParams

PROMPT = "Here is a JSON value that matches the schema:\n"
MAX_TOKENS = 256

_words = st.text(alphabet="abcdefghijklmnop", min_size=1, max_size=6)


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 500)),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 12)),
        st.just({"type": "boolean"}),
        st.lists(_words, min_size=1, max_size=4, unique=True).map(lambda values: {"enum": values}),
        st.sampled_from([{"type": "string", "format": "date"}, {"type": "string", "format": "email", "maxLength": 30},
                         {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}, {"type": "null"}]),
    )


def _object(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, dict[str, Any]], required: list[bool]) -> dict[str, Any]:
        names = list(props)
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": [n for n, r in zip(names, required, strict=False) if r]}
    return st.builds(build, st.dictionaries(_words, children, min_size=1, max_size=3),
                     st.lists(st.booleans(), min_size=3, max_size=3))


def _schema() -> st.SearchStrategy[dict[str, Any]]:
    return st.recursive(
        _leaf(),
        lambda children: st.one_of(
            _object(children),
            st.builds(lambda items, n: {"type": "array", "items": items, "minItems": 1, "maxItems": n},
                      children, st.integers(1, 3)),
            st.builds(lambda a, b: {"anyOf": [a, b]}, children, children),
        ),
        max_leaves=5,
    ).map(lambda s: s if s.get("type") == "object" else {"type": "object", "properties": {"value": s},
                                                          "required": ["value"], "additionalProperties": False})


def _generate(llm: LLM, schemas: list[dict[str, Any]], **sampling: Any) -> list[Any]:
    params = [SamplingParams(max_tokens=MAX_TOKENS, guided=GuidedDecoding(json=json.dumps(s)), **sampling)
              for s in schemas]
    return [o.outputs[0] for o in llm.generate([PROMPT + json.dumps(s) + "\n" for s in schemas], params)]


def _check(schemas: list[dict[str, Any]], outputs: list[Any]) -> None:
    for schema, output in zip(schemas, outputs, strict=True):
        assert output.finish_reason == "stop", (schema, output.text)
        jsonschema.validate(json.loads(output.text), schema, format_checker=jsonschema.FormatChecker())


@pytest.fixture(scope="module")
def llm():
    with LLM(kv_cache_memory="256MiB", max_num_seqs=16) as engine:
        yield engine


@pytest.fixture(scope="module")
def spec_llm():
    with LLM(kv_cache_memory="256MiB", max_num_seqs=16,
             speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}) as engine:
        yield engine


@pytest.fixture(scope="module")
def plain_llm():
    with LLM(kv_cache_memory="256MiB", max_num_seqs=16, jump_forward=False) as engine:
        yield engine


_PROPERTY = settings(max_examples=2, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_PROPERTY
@given(st.lists(_schema(), min_size=4, max_size=4))
def test_every_output_validates_greedy_and_sampled(llm: LLM, schemas: list[dict[str, Any]]) -> None:
    _check(schemas, _generate(llm, schemas, temperature=0))
    _check(schemas, _generate(llm, schemas, temperature=1.0, seed=7))


@_PROPERTY
@given(st.lists(_schema(), min_size=4, max_size=4))
def test_speculation_keeps_greedy_output_and_validity(llm: LLM, spec_llm: LLM, schemas: list[dict[str, Any]]) -> None:
    plain = _generate(llm, schemas, temperature=0)
    drafted = _generate(spec_llm, schemas, temperature=0)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    _check(schemas, drafted)
    _check(schemas, _generate(spec_llm, schemas, temperature=0.8, seed=3))


@_PROPERTY
@given(st.lists(_schema(), min_size=3, max_size=3))
def test_without_jump_forward_outputs_validate_too(plain_llm: LLM, schemas: list[dict[str, Any]]) -> None:
    _check(schemas, _generate(plain_llm, schemas, temperature=0))


def test_jump_forward_takes_fewer_steps_for_the_same_json(llm: LLM, plain_llm: LLM) -> None:
    schema = {"type": "object", "properties": {"first_name_of_the_person": {"enum": ["Ada", "Alan"]},
                                               "year_of_birth_in_the_gregorian_calendar": {"type": "integer"}},
              "required": ["first_name_of_the_person", "year_of_birth_in_the_gregorian_calendar"],
              "additionalProperties": False}
    forced_before = llm.engine.load().structured["forced_tokens"]
    fast, = _generate(llm, [schema], temperature=0)
    slow, = _generate(plain_llm, [schema], temperature=0)
    _check([schema], [fast])
    _check([schema], [slow])
    forced = llm.engine.load().structured["forced_tokens"] - forced_before
    assert forced >= 10  # the long keys: appended, not sampled
    assert plain_llm.engine.load().structured["forced_tokens"] == 0


def test_no_cross_talk_in_a_batch(llm: LLM) -> None:
    free_prompt = "The capital of France is"
    alone = llm.generate([free_prompt], SamplingParams(max_tokens=24, temperature=0))[0].outputs[0].token_ids
    regex = GuidedDecoding(regex="[0-9]{4}-[0-9]{2}")
    batch = llm.generate(
        [free_prompt, "A date:", free_prompt, "Pick one:"],
        [SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=24, temperature=0, guided=regex),
         SamplingParams(max_tokens=24, temperature=0),
         SamplingParams(max_tokens=8, temperature=0.9, seed=1, n=3, guided=GuidedDecoding(choice=("red", "blue")))])
    assert batch[0].outputs[0].token_ids == alone
    assert batch[2].outputs[0].token_ids == alone
    assert len(batch[1].outputs[0].text) == 7 and batch[1].outputs[0].text[4] == "-"
    assert all(o.text in ("red", "blue") for o in batch[3].outputs)


def test_an_engine_side_compile_failure_ends_only_that_request(llm: LLM) -> None:
    bad = SamplingParams(max_tokens=8, guided=GuidedDecoding(grammar="start: <[999999]>"))
    good = SamplingParams(max_tokens=8, temperature=0)
    failed, served = llm.generate(["x", "The sky is"], [bad, good])
    assert failed.outputs[0].finish_reason == "abort" and not failed.outputs[0].token_ids
    assert served.outputs[0].finish_reason == "length" and served.outputs[0].text


TOOL_SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"], "additionalProperties": False},
    "set_alarm": {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                                   "label": {"type": "string", "maxLength": 16}},
                  "required": ["hour"], "additionalProperties": False},
}


def test_tool_grammars_make_calls_their_parsers_read_back_as_valid(llm: LLM) -> None:
    formats = ["hermes", "kimi_k2", "deepseek_v31", "qwen3_coder"]
    parsers = [TOOL_PARSERS[name]() for name in formats]
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in TOOL_SCHEMAS.items()]
    prompts = [parser.system_prompt(tools) + "\nUser: Wake me at 7 and tell me the weather in Paris.\nAssistant: "
               for parser in parsers]
    params = [SamplingParams(max_tokens=160, temperature=0, guided=GuidedDecoding(
        grammar=tool_call_grammar(parser, TOOL_SCHEMAS, {}, required=True, parallel=False))) for parser in parsers]
    for parser, result in zip(parsers, llm.generate(prompts, params), strict=True):
        output = result.outputs[0]
        assert output.finish_reason == "stop", (parser.name, output.text)
        calls = parser.parse(output.text, TOOL_SCHEMAS).tool_calls
        assert len(calls) == 1, (parser.name, output.text)
        jsonschema.validate(json.loads(calls[0].arguments), TOOL_SCHEMAS[calls[0].name])


RESUMED = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 24},
                                            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                     "minItems": 1, "maxItems": 3},
                                            "pages": {"type": "integer", "minimum": 1, "maximum": 900}},
           "required": ["title", "tags", "pages"], "additionalProperties": False}


def test_a_request_handed_part_of_its_output_resumes_the_grammar(llm: LLM) -> None:
    """What a decode worker or a migration target does: the request arrives with output tokens
    generated elsewhere (`prior_output_ids`), its matcher catches up over them and decoding goes
    on under the grammar. Greedy, the resumed output is the uninterrupted one, from a cut after
    the first token, inside the first key, and in the middle."""
    prompt = llm.engine.tokenize(PROMPT + json.dumps(RESUMED) + "\n")
    whole, = _generate(llm, [RESUMED], temperature=0)
    _check([RESUMED], [whole])
    ids = list(whole.token_ids)
    core = llm.engine.core
    for cut in (1, 3, len(ids) // 2):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, guided=GuidedDecoding(json=json.dumps(RESUMED)))
        core.add_request(EngineCoreRequest(f"resumed-{cut}", list(prompt), params, prior_output_ids=ids[:cut]))
        resumed: list[int] = []
        errors = []
        # Bounded by steps, not seconds; generous, since a step with nothing to run (a grammar
        # still compiling on a loaded box) only waits a few milliseconds before returning.
        for _ in range(20_000):
            if not core.has_unfinished():
                break
            for delta in core.step():
                errors.append(delta.error)
                for sequence in delta.sequences:
                    resumed.extend(sequence.token_ids)
        assert not core.has_unfinished() and not any(errors), errors
        assert ids[:cut] + resumed == ids, (cut, llm.tokenizer.decode(ids[:cut] + resumed), whole.text)
