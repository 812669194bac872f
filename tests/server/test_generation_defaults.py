"""--override-generation-config: a request that leaves out a sampling field or max_tokens gets
the server's default, and one that names it keeps its own (vLLM's flag). Codex sends neither
a temperature nor max_output_tokens; without a default it samples at 1.0 until the context is
full. A real server on the default model, over chat, completions and Responses (legacy
completions keep OpenAI's max_tokens default of 16, as vLLM's do)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tandem.config import GenerationDefaults
from tests.support.live_server import LiveServer, start_server, stop_server

MODEL = "smollm2-135m"
DEFAULT_TOKENS = 6
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}], "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    logs = tmp_path_factory.mktemp("generation-defaults")
    defaults = json.dumps({"temperature": 0, "max_new_tokens": DEFAULT_TOKENS})
    live = start_server(logs / "serve.log", "--kv-cache-memory", "64MiB", "--override-generation-config", defaults)
    yield live
    assert not stop_server(live)


def _chat(server: LiveServer, **fields: object) -> dict:
    reply = server.post("/v1/chat/completions", ASK | fields)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_request_without_max_tokens_or_temperature_gets_the_servers(server: LiveServer) -> None:
    first, second = _chat(server, seed=1), _chat(server, seed=2)
    assert first["usage"]["completion_tokens"] == DEFAULT_TOKENS
    assert first["choices"][0]["finish_reason"] == "length"
    # Greedy by the server's default: other seeds, the explicit temperature 0's text.
    greedy = _chat(server, temperature=0, max_tokens=DEFAULT_TOKENS)
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"] \
        == greedy["choices"][0]["message"]["content"]
    # Legacy completions keep OpenAI's max_tokens of 16; the temperature default applies.
    texts = []
    for seed in (1, 2):
        completion = server.post("/v1/completions", {"model": MODEL, "prompt": "The sea is", "seed": seed})
        assert completion.status_code == 200, completion.text
        texts.append(completion.json()["choices"][0]["text"])
    assert texts[0] == texts[1]
    assert server.wait_idle()["kv_blocks_used"] == 0


def test_what_the_request_names_wins(server: LiveServer) -> None:
    assert _chat(server, max_tokens=DEFAULT_TOKENS + 3)["usage"]["completion_tokens"] == DEFAULT_TOKENS + 3
    greedy = _chat(server, max_tokens=16)["choices"][0]["message"]["content"]
    hot = [_chat(server, max_tokens=16, temperature=2.0, seed=seed)["choices"][0]["message"]["content"]
           for seed in (1, 2)]
    assert hot[0] != hot[1] and greedy not in hot  # sampled, not the default's greedy


def test_a_responses_request_without_max_output_tokens_is_cut_at_the_default(server: LiveServer) -> None:
    reply = server.post("/v1/responses", {"model": MODEL, "input": "Tell me about the sea."})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["output_tokens"] <= DEFAULT_TOKENS
    if body["usage"]["output_tokens"] == DEFAULT_TOKENS:
        assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize(("text", "message"), [
    ('{"temperature": -1}', "temperature -1 is out of range"),
    ('{"top_p": 0}', "top_p 0 is out of range"),
    ('{"temperature": Infinity}', "temperature inf is out of range"),
    ('{"min_p": NaN}', "min_p nan is out of range"),
    ('{"max_new_tokens": 0}', "max_new_tokens 0 is out of range"),
    ('{"max_new_tokens": 2.5}', "max_new_tokens must be an integer"),
    ('{"temperature": true}', "temperature must be a number"),
    ('{"temperature": "hot"}', "temperature must be a number"),
    ('{"seed": 3}', "'seed' is not one of"),
    ('[1, 2]', "must be a JSON object"),
    ('{temperature: 1}', "is not JSON"),
])
def test_a_bad_override_is_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GenerationDefaults.from_json(text)


def test_the_parsed_defaults() -> None:
    defaults = GenerationDefaults.from_json('{"temperature": 1, "top_k": 20, "max_new_tokens": 512}')
    assert defaults.sampling_fields() == {"temperature": 1.0, "top_k": 20}
    assert isinstance(defaults.sampling_fields()["temperature"], float)
    assert defaults.max_new_tokens == 512 and GenerationDefaults.from_json(None).max_new_tokens is None
