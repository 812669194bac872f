"""Structured outputs on a live `tandem serve` (the session server, default model), through the
openai SDK: `response_format` json_schema / json_object, vLLM's `structured_outputs` and older
`guided_*` fields, on chat and completions.

Everything is greedy, so a whole and a streamed answer agree. The schemas, regexes and prompts
are picked so that the constraint bites: what the model writes unconstrained (a longer name, an
age over the maximum, a colour outside the enum, an ISO date) is not what the constraint
allows, so output that validates is the grammar's doing, not the model's.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.support.router_helpers import metric

MODEL = "smollm2-135m"

# Nested: an object holding an array of enum strings and an object; integers with ranges,
# strings with a maxLength. The prompt asks for what the schema forbids (a 57-year-old, a
# 11-letter name, red), so the masks have to steer the model.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 18, "maximum": 50},
        "colours": {"type": "array", "items": {"type": "string", "enum": ["green", "blue"]},
                    "minItems": 1, "maxItems": 2},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "colours", "address"],
    "additionalProperties": False,
}
PERSON_PROMPT = [{"role": "user", "content": "Describe a person called Adalbertina, who is 57 years old and loves "
                                             "the colour red, as JSON: name, age, favourite colours and address."}]
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

SEA = {"type": "object",
       "properties": {"mood": {"type": "string", "enum": ["calm", "stormy", "grey"]},
                      "waves": {"type": "integer", "minimum": 0, "maximum": 30}},
       "required": ["mood", "waves"], "additionalProperties": False}
SEA_PROMPT = [{"role": "user", "content": "Describe the sea today as JSON."}]
SEA_REQUEST = {"model": MODEL, "messages": SEA_PROMPT, "max_tokens": 40, "temperature": 0,
               "response_format": {"type": "json_schema", "json_schema": {"name": "sea", "schema": SEA}}}


@pytest.fixture(scope="module")
def client(tandem_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tandem_server}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def sea_alone(tandem_server: str) -> str:
    """The SEA answer of a request that runs alone."""
    reply = httpx.post(f"{tandem_server}/v1/chat/completions", json=SEA_REQUEST, timeout=300)
    assert reply.status_code == 200, reply.text
    content = reply.json()["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), SEA)
    return content


def _streamed_content(stream: Any) -> str:
    return "".join(choice.delta.content or "" for chunk in stream for choice in chunk.choices)


def test_json_schema_nested_whole_and_streamed(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=PERSON_PROMPT, temperature=0, max_tokens=80,
                                           response_format=PERSON_FORMAT)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice  # the grammar ended the output, not the length
    person_whole = choice.message.content
    jsonschema.validate(json.loads(person_whole), PERSON)
    streamed = _streamed_content(client.chat.completions.create(
        model=MODEL, messages=PERSON_PROMPT, temperature=0, max_tokens=80, response_format=PERSON_FORMAT,
        stream=True))
    assert streamed == person_whole


def test_guided_json_is_the_same_constraint(client: openai.OpenAI, sea_alone: str) -> None:
    """vLLM's older `guided_json` field: the same schema, the same greedy answer."""
    reply = client.chat.completions.create(model=MODEL, messages=SEA_PROMPT, temperature=0, max_tokens=40,
                                           extra_body={"guided_json": SEA})
    assert reply.choices[0].message.content == sea_alone


def test_json_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=40, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Reply with a JSON object whose key "answer" holds the capital '
                                              "of France."}])
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_completion_regex(client: openai.OpenAI) -> None:
    # Unconstrained, the model writes " 2023-01-01.": the regex asks for another date format, whose
    # first token is not a digit (forced tokens alone, jump-forward, would not make it match).
    pattern = r" (March|June) [1-9][0-9]?, 19[0-9]{2}\."
    reply = client.completions.create(model=MODEL, prompt="The date today is", temperature=0, max_tokens=20,
                                      extra_body={"response_format": {"type": "regex", "regex": pattern}})
    assert reply.choices[0].finish_reason == "stop"
    assert re.fullmatch(pattern, reply.choices[0].text), reply.choices[0].text


def test_completion_structured_outputs_choice(client: openai.OpenAI) -> None:
    choices = [" purple", " seven", " a teapot"]
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=20,
                                      extra_body={"structured_outputs": {"choice": choices}})
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text in choices


def test_forced_tokens_are_counted(client: openai.OpenAI, tandem_server: str) -> None:
    """A single choice leaves the model one token to pick; the grammar forces all the rest
    (jump-forward), and /metrics and /load count them."""
    def counters() -> tuple[float, dict[str, Any]]:
        text = httpx.get(f"{tandem_server}/metrics", timeout=60).text
        forced = metric(text, "tandem:structured_forced_tokens_total", model_name=MODEL)
        return forced, httpx.get(f"{tandem_server}/load", timeout=60).json()["structured"]

    forced_before, load_before = counters()
    only = " hippopotamus of the northern savannah, which sleeps all day"
    reply = client.completions.create(model=MODEL, prompt="My favourite animal is the", temperature=0, max_tokens=40,
                                      extra_body={"structured_outputs": {"choice": [only]}})
    assert reply.choices[0].text == only and reply.choices[0].finish_reason == "stop"
    forced_after, load_after = counters()
    tokens = reply.usage.completion_tokens
    assert tokens >= 8
    assert forced_after - forced_before == tokens - 1  # all but the first, sampled under the mask
    assert load_after["forced_tokens"] - load_before["forced_tokens"] == tokens - 1
    assert load_after["requests"] - load_before["requests"] == 1
    assert load_after["mask_rows"] > load_before["mask_rows"]


HELLO = [{"role": "user", "content": "Hello"}]
BAD_REQUESTS = [
    ("bad schema type", "chat",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "invalid_grammar", "nonsense"),
    ("guided_json bad schema type", "completions", {"guided_json": {"type": "nonsense"}},
     "guided_json", "invalid_grammar", "nonsense"),
    ("lark unknown rule", "chat", {"response_format": {"type": "grammar", "grammar": "start: missing_rule"}},
     "response_format", "invalid_grammar", "missing_rule"),
    ("ebnf that does not parse", "chat",
     {"response_format": {"type": "grammar", "syntax": "ebnf", "grammar": 'root ::= ("a" '}},
     "response_format", "invalid_grammar", "does not parse"),
    ("guided_grammar ebnf that does not parse", "completions", {"guided_grammar": 'root ::= ("a" | "b"'},
     "guided_grammar", "invalid_grammar", "does not parse"),
    ("two constraints at once", "chat", {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "guided_regex", "invalid_value", "at most one"),
    ("structured_outputs with two kinds", "completions",
     {"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs", "invalid_value", "exactly one"),
    ("json_schema without schema", "chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "invalid_value", "schema"),
]


@pytest.mark.parametrize(("case", "endpoint", "extra", "param", "code", "says"), BAD_REQUESTS,
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_constraint_is_a_400_and_the_server_still_serves(client: openai.OpenAI, case: str, endpoint: str,
                                                             extra: dict[str, Any], param: str, code: str,
                                                             says: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body=extra)
    error = caught.value.body
    assert (error["param"], error["code"]) == (param, code), error
    assert says in error["message"], error
    after = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0)
    assert after.choices[0].finish_reason in ("stop", "length") and after.usage.completion_tokens >= 1


def test_a_grammar_only_the_engine_refuses_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, extra_body={
            "response_format": {"type": "grammar", "grammar": "start: <[99999999]>"}})
    assert "99999999" in caught.value.body["message"]


def _stream_chat(url: str, body: dict[str, Any]) -> list[tuple[float, str]]:
    """A streamed chat completion's content deltas, each with when it arrived (monotonic)."""
    deltas = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=300) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    if choice["delta"].get("content"):
                        deltas.append((time.monotonic(), choice["delta"]["content"]))
    return deltas


def test_constrained_and_free_requests_together_do_not_cross_talk(tandem_server: str, sea_alone: str) -> None:
    """A free request decoding while a constrained one joins its batch: the free one's greedy
    text is what it is alone (no mask leaks onto its rows), and the constrained one validates
    and is what it is alone (its mask stays on its own rows)."""
    free = {"model": MODEL, "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
            "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{tandem_server}/v1/chat/completions", json=free, timeout=300)
    assert reply.status_code == 200, reply.text
    free_alone = reply.json()["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(1) as pool:
        joining: Future[list[tuple[float, str]]] | None = None
        free_deltas = []
        with httpx.stream("POST", f"{tandem_server}/v1/chat/completions", json={**free, "stream": True},
                          timeout=300) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        if choice["delta"].get("content"):
                            free_deltas.append((time.monotonic(), choice["delta"]["content"]))
                    if free_deltas and joining is None:  # the free one is decoding: the other joins
                        joining = pool.submit(_stream_chat, tandem_server, SEA_REQUEST)
        assert joining is not None
        constrained_deltas = joining.result()
    # The constrained request got a token while the free one was still decoding: a step ran
    # both (one batch per step).
    assert constrained_deltas[0][0] < free_deltas[-1][0], "the two requests never shared a step"
    assert "".join(text for _, text in free_deltas) == free_alone
    assert "".join(text for _, text in constrained_deltas) == sea_alone
