"""Structured outputs through a PD split: prefill and decode workers (Qwen2.5-Coder-0.5B, whose
template knows tools) behind `tandem route`. The prefill worker samples the first token under
the grammar; the decode worker advances its own matcher over that handed token and goes on from
there. So a greedy constrained answer through PD, whole and streamed, is the one a single worker
gives, and it validates.

The prompts are picked so that the first token is the grammar's doing: unconstrained, the model
starts with prose, not `{`, so a prefill worker that sampled freely would hand the decode worker
a token its grammar refuses.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

from tandem.loader.resolve import default_cache_dir
from tests.support.pd_cluster import PdCluster, pd_cluster
from tests.support.router_helpers import metric

MODEL = "qwen2.5-coder-0.5b"
GGUF = default_cache_dir() / "models" / f"{MODEL}.gguf"
# Blocks of 16 tokens: a short prompt still hands a block off.
ARGS = (MODEL, "--kv-cache-memory", "512MiB", "--threads", "1", "--max-num-seqs", "4", "--block-size", "16")

CITY = {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
                       "landmarks": {"type": "array", "maxItems": 2,
                                     "items": {"type": "string", "enum": ["tower", "bridge", "museum"]}}},
        "required": ["city", "population_millions", "landmarks"], "additionalProperties": False}
CITY_PROMPT = [{"role": "user", "content": "Describe Paris."}]
CITY_REQUEST = {"model": MODEL, "messages": CITY_PROMPT, "max_tokens": 60, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}}

ALARM = {"type": "object",
         "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                        "minute": {"type": "integer", "minimum": 0, "maximum": 59}},
         "required": ["hour", "minute"], "additionalProperties": False}
TOOLS_REQUEST = {"model": MODEL, "messages": [{"role": "user", "content": "Wake me up at 25:70, please."}],
                 "max_tokens": 40, "temperature": 0, "tool_choice": "required",
                 "tools": [{"type": "function", "function": {"name": "set_alarm", "description": "Set an alarm clock",
                                                             "parameters": ALARM}}]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdCluster]:
    assert GGUF.is_file(), f"{GGUF} is missing: run scripts/setup.sh (it assembles {MODEL})"
    with pd_cluster(tmp_path_factory.mktemp("router-structured"), *ARGS) as made:
        yield made


def _message(reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "tool_calls"), choice  # the grammar ended it, not the length
    return choice["message"]


def _message_text(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def _streamed(url: str, body: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
    """A streamed chat completion's content and its tool calls (name, arguments), joined up."""
    content: list[str] = []
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=300) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                content.append(choice["delta"].get("content") or "")
                for call in choice["delta"].get("tool_calls") or []:
                    function = call.get("function") or {}
                    names[call["index"]] = names.get(call["index"], "") + (function.get("name") or "")
                    arguments[call["index"]] = arguments.get(call["index"], "") + (function.get("arguments") or "")
    return "".join(content), [(names[i], arguments.get(i, "")) for i in sorted(names)]


def _pd_requests(cluster: PdCluster) -> float:
    text = httpx.get(f"{cluster.url}/metrics", timeout=60).text
    return metric(text, "tandem_router_requests_total", route="pd", endpoint="chat", status="200")


def test_json_schema_through_pd_is_the_single_worker_answer(cluster: PdCluster) -> None:
    free = cluster.decode.post("/v1/chat/completions", {**CITY_REQUEST, "response_format": None, "max_tokens": 1},
                               timeout=300)
    assert not _message_text(free).startswith("{")  # the first token under the grammar is not the free one
    alone = _message(cluster.decode.post("/v1/chat/completions", CITY_REQUEST, timeout=300))["content"]
    jsonschema.validate(json.loads(alone), CITY)
    before = _pd_requests(cluster)
    whole = _message(httpx.post(f"{cluster.url}/v1/chat/completions", json=CITY_REQUEST, timeout=300))
    assert whole["content"] == alone
    assert _streamed(cluster.url, CITY_REQUEST) == (alone, [])
    assert _pd_requests(cluster) - before == 2  # both went through the split


def test_required_tool_call_through_pd_is_the_single_worker_call(cluster: PdCluster) -> None:
    alone = _message(cluster.decode.post("/v1/chat/completions", TOOLS_REQUEST, timeout=300))
    calls = [(call["function"]["name"], call["function"]["arguments"]) for call in alone["tool_calls"]]
    assert [name for name, _ in calls] == ["set_alarm"]
    jsonschema.validate(json.loads(calls[0][1]), ALARM)
    before = _pd_requests(cluster)
    whole = _message(httpx.post(f"{cluster.url}/v1/chat/completions", json=TOOLS_REQUEST, timeout=300))
    assert [(call["function"]["name"], call["function"]["arguments"]) for call in whole["tool_calls"]] == calls
    assert not whole["content"]
    assert _streamed(cluster.url, TOOLS_REQUEST) == ("", calls)
    assert _pd_requests(cluster) - before == 2
