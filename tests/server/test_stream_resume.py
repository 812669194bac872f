"""A stream continued on a worker from the token ids another worker's stream reported.

This is the worker's half of the router's mid-stream migration: `return_token_ids` puts each
step's token ids on its chunk (held-back text included), and a request carrying some of them
as `first_token_ids` with `streamed_from` sends exactly the rest of the text: what the first
stream held back (a possible stop string's start) and what it never generated. Cut at every
few chunks, the two halves must join into the whole stream, text and tool calls alike.

The handoff fields are internal (tandem/trust): the worker here has a cluster secret and the
test signs its requests as the router does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tandem.trust.peer import peer_client
from tests.support.live_server import TEST_SECRET, LiveServer, start_server, stop_server

MODEL = "smollm2-135m"
STORY = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def peer_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server: LiveServer = start_server(tmp_path_factory.mktemp("resume") / "serve.log", "--kv-cache-memory", "128MiB",
                                      secret=TEST_SECRET)
    yield server.url
    assert not stop_server(server)


def _chunks(url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> list[dict[str, Any]]:
    chunks = []
    with peer_client(TEST_SECRET, timeout=120) as client, \
            client.stream("POST", f"{url}{path}", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _choice_chunks(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["choices"][0] for c in chunks if c.get("choices")]


def _content(choices: list[dict[str, Any]]) -> str:
    return "".join((c.get("delta") or {}).get("content") or c.get("text") or "" for c in choices)


def _arguments(choices: list[dict[str, Any]]) -> str:
    return "".join(t["function"].get("arguments") or "" for c in choices
                   for t in (c.get("delta") or {}).get("tool_calls") or [])


def _resume(ids: list[int], streamed_from: int = 0) -> dict[str, Any]:
    return {"do_remote_prefill": True, "first_token_ids": ids, "emit_first_token": False,
            "streamed_from": streamed_from}


def test_token_ids_cover_every_token_and_a_resumed_stream_joins_up(peer_worker: str) -> None:
    # A stop string the text never reaches still holds back its length - 1 characters.
    body = {"model": MODEL, "messages": STORY, "max_tokens": 40, "temperature": 0, "stop": ["@@@@"],
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    whole = _chunks(peer_worker, body)
    choices = _choice_chunks(whole)
    ids = [t for c in choices for t in c.get("token_ids", [])]
    assert len(ids) == whole[-1]["usage"]["completion_tokens"] == 40
    full = _content(choices)
    assert len(full) > 60
    held = [i for i, c in enumerate(choices) if c.get("token_ids") and not c["delta"]]
    assert held, "the stop string's hold-back should leave some chunks with ids but no text"
    plain = _chunks(peer_worker, {k: v for k, v in body.items() if k != "return_token_ids"})
    assert _content(_choice_chunks(plain)) == full
    assert all("token_ids" not in c for c in _choice_chunks(plain))
    for cut in (2, 7, 15, len(choices) - 3):
        seen = choices[: cut + 1]
        sent = [t for c in seen for t in c.get("token_ids", [])]
        rest = _chunks(peer_worker, {**body, "kv_transfer_params": _resume(sent)})
        assert _content(seen) + _content(_choice_chunks(rest)) == full, cut
        assert rest[-1]["usage"]["completion_tokens"] == 40
        resumed_ids = [t for c in _choice_chunks(rest) for t in c.get("token_ids", [])]
        assert sent + resumed_ids == ids


def test_a_resumed_completion_stream_and_a_bad_streamed_from(peer_worker: str) -> None:
    body = {"model": MODEL, "prompt": "The three primary colours are", "max_tokens": 24, "temperature": 0,
            "return_token_ids": True}
    choices = _choice_chunks(_chunks(peer_worker, body, "/v1/completions"))
    seen = choices[:5]
    sent = [t for c in seen for t in c["token_ids"]]
    rest = _chunks(peer_worker, {**body, "kv_transfer_params": _resume(sent)}, "/v1/completions")
    assert _content(seen) + _content(_choice_chunks(rest)) == _content(choices)
    with peer_client(TEST_SECRET, timeout=30) as client:
        bad = client.post(f"{peer_worker}/v1/completions",
                          json={**body, "stream": True, "kv_transfer_params": _resume(sent, len(sent) + 1)})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params"


def test_the_tool_call_parser_goes_on_where_the_first_stream_stopped(peer_worker: str) -> None:
    """The new worker's tool-call parser reads what the client has before it goes on: text it
    held back (trailing whitespace that could precede a call) comes now, and a call cut in the
    middle comes whole, its id and name once."""
    tools = {"model": MODEL, "messages": [{"role": "user", "content": "Find the weather for Tokyo, please."}],
             "tools": [WEATHER_TOOL], "max_tokens": 60, "temperature": 0, "return_token_ids": True}
    choices = _choice_chunks(_chunks(peer_worker, tools))
    full = _content(choices)
    held = [i for i, c in enumerate(choices) if c.get("token_ids") and not c["delta"]]
    assert held and "\n" in full
    for cut in [*held, held[0] - 1, len(choices) // 2]:
        seen = choices[: cut + 1]
        sent = [t for c in seen for t in c.get("token_ids", [])]
        rest = _choice_chunks(_chunks(peer_worker, {**tools, "kv_transfer_params": _resume(sent)}))
        assert _content(seen) + _content(rest) == full, cut

    named = {**tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    choices = _choice_chunks(_chunks(peer_worker, named))
    arguments = _arguments(choices)
    assert json.loads(arguments)
    seen = choices[: len(choices) // 2]
    assert not _arguments(seen)
    sent = [t for c in seen for t in c.get("token_ids", [])]
    rest = _choice_chunks(_chunks(peer_worker, {**named, "kv_transfer_params": _resume(sent)}))
    assert _arguments(rest) == arguments
    calls = [t for c in rest for t in (c.get("delta") or {}).get("tool_calls") or []]
    assert [t["function"].get("name") for t in calls if t.get("id")] == ["get_weather"]
    assert [c["finish_reason"] for c in rest if c["finish_reason"]] == ["tool_calls"]


def test_kv_release_refuses_a_body_without_a_transfer_id(peer_worker: str) -> None:
    with peer_client(TEST_SECRET, timeout=30) as client:  # a control endpoint: the router's, signed
        for body in ({}, {"transfer_id": 5}, {"transfer_id": ""}):
            reply = client.post(f"{peer_worker}/kv/release", json=body)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == "transfer_id"
        reply = client.post(f"{peer_worker}/kv/release", content=b"not json")
        assert reply.status_code == 400
        ok = client.post(f"{peer_worker}/kv/release", json={"transfer_id": "nobody-holds-this"})
        assert ok.json() == {"released": True}  # an unknown id is a no-op
        assert client.get(f"{peer_worker}/health").status_code == 200
