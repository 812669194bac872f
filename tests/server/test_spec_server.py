"""`tandem serve --speculative-config`: same answers as without it, counters in /metrics,
a per-request opt-out, and a bad config refused at start with a message."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.live_server import LiveServer, start_server, stop_server

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
MESSAGES = [{"role": "user", "content":
             'Repeat this JSON exactly: {"name": "grep", "arguments": {"pattern": "TODO", "path": "src/"}}'}]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("spec") / "serve.log", "--kv-cache-memory", "128MiB",
                          "--speculative-config", SPEC)
    yield server
    assert not stop_server(server)


def counter(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(f"tandem:{name}{{") or line.startswith(f"tandem:{name}_total{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_answers_match_the_server_without_speculation(spec_server: LiveServer, tandem_server: str) -> None:
    answers = []
    for url in (spec_server.url, tandem_server):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        stream = client.chat.completions.create(model="smollm2-135m", messages=MESSAGES, temperature=0,
                                                max_tokens=48, stream=True)
        answers.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
    assert answers[0] == answers[1]
    metrics = httpx.get(f"{spec_server.url}/metrics").text
    assert counter(metrics, "spec_decode_num_drafts") > 0
    assert counter(metrics, "spec_decode_num_accepted_tokens") > 0
    assert 'tandem:spec_decode_num_accepted_tokens_per_pos_total{model_name="smollm2-135m",position="0"}' in metrics
    assert spec_server.load()["spec_decode"]["mean_acceptance_length"] > 1.0


def test_a_request_can_opt_out(spec_server: LiveServer) -> None:
    before = spec_server.load()["spec_decode"]["num_drafts"]
    client = openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="none")
    reply = client.chat.completions.create(model="smollm2-135m", messages=MESSAGES, temperature=0, max_tokens=32,
                                           extra_body={"speculate": False})
    assert reply.choices[0].message.content
    assert spec_server.load()["spec_decode"]["num_drafts"] == before
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2-135m", messages=MESSAGES, max_tokens=4,
                                       extra_body={"speculate": "sometimes"})


@pytest.mark.parametrize(("config", "message"), [
    ('{"method": "medusa", "num_speculative_tokens": 2}', "unknown speculative method 'medusa'"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens must be in 1..16"),
    ('{"method": "ngram"', "not valid JSON"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', "unknown key(s) lookahead"),
    ('{"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 2, "draft_decode_weights": "int3"}',
     "draft_decode_weights must be none or one of float16, bfloat16, int4"),
])
def test_a_bad_config_is_refused_at_start(config: str, message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "tandem", "serve", "--speculative-config", config],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr
