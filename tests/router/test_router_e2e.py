"""`tandem route` in front of real workers: 1 prefill + 1 decode `tandem serve`, default model.

Greedy output through the router (prefill hop, KV handoff, decode hop, merge) must equal what
one `tandem serve` produces alone (the session's `tandem_server`), whole and streamed, chat
and completions, one at a time and concurrently. The router runs as `python -m tandem route`,
as a user starts it, with the model's tokenizer and a low PD threshold (32 tokens) so that
one-line prompts go whole to the decode worker and everything longer is disaggregated.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tandem.loader.resolve import resolve_model
from tandem.platform.ports import free_port
from tandem.router.config import HealthPolicy, WorkerSpec
from tests.support.live_server import TEST_SECRET, LiveServer, start_server, stop_server
from tests.support.router_helpers import MODEL_TIMEOUTS, read_stream, stream_text, wait_for

MODEL = "smollm2-135m"
# Blocks of 16 tokens, as the session's server (tests/conftest.py) that the answers are compared with.
WORKER_ARGS = ("--kv-cache-memory", "256MiB", "--threads", "1", "--max-num-seqs", "16", "--block-size", "16")
PD_MIN = 32
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOL_PROMPT = [{"role": "user", "content": "Find the weather for Tokyo, please."}]
CONTEXT = (
    "You are a helpful assistant for a travel agency. You answer questions about cities, "
    "their history, food and weather briefly and precisely. "
) * 5


@dataclass
class Cluster:
    prefill: LiveServer
    decode: LiveServer
    router: str
    router_process: subprocess.Popen[bytes]
    router_log: Path

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.router}/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            named = line.startswith(name + "{") or line.startswith(name + " ")
            if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


def _start_router(log_path: Path, *args: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "tandem",
        "--log-level",
        "INFO",
        "route",
        "--port",
        str(port),
        *args,
    ]
    with Path(log_path).open("wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", TANDEM_CLUSTER_SECRET=TEST_SECRET),
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, Path(log_path).read_text()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url, process
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"router not healthy:\n{Path(log_path).read_text()}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("router-e2e")
    prefill = start_server(logs / "prefill.log", "--role", "prefill", *WORKER_ARGS, secret=TEST_SECRET)
    decode: LiveServer | None = None
    process: subprocess.Popen[bytes] | None = None
    try:
        decode = start_server(logs / "decode.log", "--role", "decode", *WORKER_ARGS, secret=TEST_SECRET)
        tokenizer = resolve_model(MODEL, "float32").hf_dir
        url, process = _start_router(
            logs / "router.log",
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--tokenizer",
            str(tokenizer),
            "--pd-min-prompt-tokens",
            str(PD_MIN),
            "--ledger",
            str(logs / "usage.sqlite3"),
        )
        yield Cluster(prefill, decode, url, process, logs / "router.log")
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0, (logs / "router.log").read_text()[-3000:]
    finally:
        if process is not None and process.poll() is None:
            process.kill()
        for server in (prefill, decode):
            if server is not None:
                assert not stop_server(server)


def _nonce() -> str:
    return f"Ticket {uuid.uuid4().hex[:12]}."


def _long_chat(question: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"{_nonce()} {CONTEXT}"},
        {"role": "user", "content": question},
    ]


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(f"{url}{path}", json=body, timeout=180)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _text(reply: dict[str, Any]) -> str:
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _run(
    url: str, path: str, body: dict[str, Any], stream: bool
) -> tuple[str, str | None, dict | None]:
    """(text, finish_reason, usage) of one request, whole or streamed."""
    if not stream:
        reply = _post(url, path, body)
        return _text(reply), reply["choices"][0]["finish_reason"], reply["usage"]
    events = read_stream(
        url, {**body, "stream_options": {"include_usage": True}}, path, timeout=180
    )
    chunks = [e for e in events if isinstance(e, dict)]
    assert events[-1] == "[DONE]" and not any("error" in c for c in chunks), chunks[-3:]
    assert (
        len({(c["id"], c["created"]) for c in chunks}) == 1
    )  # one response, whichever hop sent it
    reasons = [
        c["choices"][0]["finish_reason"]
        for c in chunks
        if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    assert len(reasons) == 1
    return stream_text(events), reasons[0], chunks[-1]["usage"]


CASES: list[tuple[str, str, Callable[[], dict[str, Any]]]] = [
    (
        "chat-long",
        "/v1/chat/completions",
        lambda: {"messages": _long_chat("What should I eat in Lisbon?"), "max_tokens": 24},
    ),
    (
        "chat-short",
        "/v1/chat/completions",
        lambda: {"messages": [{"role": "user", "content": "Hi! Who are you?"}], "max_tokens": 16},
    ),
    (
        "completion-long",
        "/v1/completions",
        lambda: {"prompt": f"{_nonce()} {CONTEXT} The capital of Portugal is", "max_tokens": 16},
    ),
    (
        "completion-short",
        "/v1/completions",
        lambda: {"prompt": "def fibonacci(n):", "max_tokens": 20},
    ),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("name", "path", "make"), CASES, ids=[c[0] for c in CASES])
def test_greedy_output_equals_one_worker(
    cluster: Cluster,
    tandem_server: str,
    name: str,
    path: str,
    make: Callable[[], dict[str, Any]],
    stream: bool,
) -> None:
    body = {"model": MODEL, "temperature": 0, **make()}
    route = "pd" if "long" in name else "direct"
    endpoint = "chat" if "chat" in path else "completion"
    before = cluster.metric("tandem_router_requests_total", route=route, endpoint=endpoint)
    pulled = cluster.decode.load()["kv_transfer"]["blocks_received"]
    text, reason, usage = _run(cluster.router, path, body, stream)
    alone = _post(tandem_server, path, body)
    assert text == _text(alone)
    assert reason == alone["choices"][0]["finish_reason"]
    assert usage is not None
    assert usage["prompt_tokens"] == alone["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == alone["usage"]["completion_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert (
        cluster.metric("tandem_router_requests_total", route=route, endpoint=endpoint) == before + 1
    )
    if route == "pd":  # the decode worker really fetched the prompt's KV
        assert cluster.decode.load()["kv_transfer"]["blocks_received"] > pulled


def test_cached_tokens_are_the_prefill_workers_counted_once(cluster: Cluster) -> None:
    body = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 8,
        "messages": _long_chat("Name a museum."),
    }
    _, _, first = _run(cluster.router, "/v1/chat/completions", body, stream=True)
    _, _, again = _run(cluster.router, "/v1/chat/completions", body, stream=False)
    assert first is not None and again is not None
    assert first["prompt_tokens_details"]["cached_tokens"] == 0  # a new prompt: nothing cached
    # The second time the prefill worker finds the prompt in its cache: exactly what it
    # reports when asked alone. The decode worker's hits (the blocks it pulled) are not added.
    reply = cluster.prefill.post("/v1/chat/completions", body)  # signed: the worker serves peers only
    assert reply.status_code == 200, reply.text
    direct = reply.json()["usage"]
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached == direct["prompt_tokens_details"]["cached_tokens"] <= again["prompt_tokens"]
    # Exactly the prompt's whole 16-token blocks, short of the last token (always computed).
    assert cached == (again["prompt_tokens"] - 1) // 16 * 16


def test_usage_ledger_matches_the_responses(cluster: Cluster) -> None:
    """Real workers, PD and direct, whole and streamed: GET /v1/usage sums what they said."""
    user = f"ledger-{uuid.uuid4().hex[:8]}"
    runs = [
        _run(cluster.router, path, {"model": MODEL, "temperature": 0, "user": user, **make()}, s)
        for (_, path, make), s in zip(CASES, (False, True, True, False), strict=True)
    ]
    usages = [usage for _, _, usage in runs]
    assert all(u is not None and "cost" in u for u in usages)
    report = httpx.get(f"{cluster.router}/v1/usage", params={"user": user}, timeout=30).json()
    total = report["total"]
    assert total["requests"] == len(runs) and total["aborted"] == total["errors"] == 0
    for field, pick in (
        ("prompt_tokens", lambda u: u["prompt_tokens"]),
        ("cached_tokens", lambda u: u["prompt_tokens_details"]["cached_tokens"]),
        ("completion_tokens", lambda u: u["completion_tokens"]),
    ):
        assert total[field] == sum(pick(u) for u in usages if u is not None), field


# Where a concurrent batch's answer may part from the same request's answered alone: the
# batch's decode steps hold other rows, so the GEMMs sum in other orders (two tokens or fewer
# take the GEMV copies, more the packed GEMM), which moves logits by ~1e-5 of their size. The
# full suite on the 2-core AVX-512 EPYC once saw "Lisbon is a city that is" become "... has";
# another request's tokens would differ from the first and far from a tie.
NEAR_TIE = 0.05


def _reference_tokens(reply: dict[str, Any]) -> list[tuple[str, float]]:
    """Each generated token's text and the nats between its two best candidates, from a reply
    asked for two top log-probabilities (chat or completions shape)."""
    logprobs = reply["choices"][0]["logprobs"]
    if "content" in logprobs:  # chat
        steps = [(entry["token"], [top["logprob"] for top in entry["top_logprobs"]]) for entry in logprobs["content"]]
    else:  # completions
        steps = list(zip(logprobs["tokens"], [list(top.values()) for top in logprobs["top_logprobs"]], strict=True))
    return [(token, (max(best) - sorted(best)[-2]) if len(best) > 1 else float("inf")) for token, best in steps]


def _same_or_parted_at_a_tie(text: str, reference: dict[str, Any]) -> bool:
    """`text` is the reference's answer, or parts from it first inside a token whose two best
    candidates were within NEAR_TIE of each other."""
    want = _text(reference)
    if text == want:
        return True
    parted = next((i for i, (a, b) in enumerate(zip(text, want, strict=False)) if a != b), min(len(text), len(want)))
    offset = 0
    for token, margin in _reference_tokens(reference):
        if offset + len(token) > parted:
            return margin < NEAR_TIE
        offset += len(token)
    return False


def _with_top_two(path: str, body: dict[str, Any]) -> dict[str, Any]:
    extra = {"logprobs": True, "top_logprobs": 2} if path.endswith("chat/completions") else {"logprobs": 2}
    return {**body, **extra}


def test_concurrent_batch_of_varied_prompts(cluster: Cluster, tandem_server: str) -> None:
    requests = []
    for i in range(8):
        path, make = CASES[i % len(CASES)][1], CASES[i % len(CASES)][2]
        body = {"model": MODEL, "temperature": 0, **make(), "max_tokens": 8 + 3 * i}
        requests.append((path, body, i % 3 == 0))
    expected = [_post(tandem_server, path, _with_top_two(path, body)) for path, body, _ in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        got = list(pool.map(lambda r: _run(cluster.router, *r), requests))
    for (text, reason, usage), alone in zip(got, expected, strict=True):
        assert _same_or_parted_at_a_tie(text, alone), (text, _text(alone))
        assert reason == alone["choices"][0]["finish_reason"]
        assert (
            usage is not None and usage["completion_tokens"] == alone["usage"]["completion_tokens"]
        )
    for server in (cluster.prefill, cluster.decode):
        load = server.wait_idle()
        assert load["kv_blocks_used"] == 0 and load["num_requests_in_flight"] == 0


def _calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [call["function"] for call in message.get("tool_calls") or []]


@pytest.mark.parametrize("pad", [False, True], ids=["as-is", "long"])
def test_tool_calls_survive_the_merge(cluster: Cluster, tandem_server: str, pad: bool) -> None:
    messages = (
        [{"role": "system", "content": f"{_nonce()} {CONTEXT}"}, *TOOL_PROMPT]
        if pad
        else TOOL_PROMPT
    )
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = {
        "model": MODEL,
        "messages": messages,
        "tools": [WEATHER_TOOL],
        "tool_choice": choice,
        "max_tokens": 60,
        "temperature": 0,
    }
    before = cluster.metric("tandem_router_requests_total", route="pd")
    alone = _post(tandem_server, "/v1/chat/completions", body)["choices"][0]
    reply = _post(cluster.router, "/v1/chat/completions", body)["choices"][0]
    assert reply["finish_reason"] == alone["finish_reason"]
    assert _calls(reply["message"]) == _calls(alone["message"])
    assert (reply["message"]["content"] or "") == (alone["message"]["content"] or "")
    if not pad:  # the short tool prompt gives a valid call on the default model
        assert reply["finish_reason"] == "tool_calls" and len(_calls(reply["message"])) == 1
        assert reply["message"]["tool_calls"][0]["id"].startswith("call_")
        assert isinstance(json.loads(_calls(reply["message"])[0]["arguments"]), dict)

    events = read_stream(cluster.router, body)
    chunks = [e for e in events if isinstance(e, dict)]
    assert len({c["id"] for c in chunks}) == 1
    pieces = [
        tc
        for c in chunks
        if c["choices"]
        for tc in (c["choices"][0]["delta"].get("tool_calls") or [])
    ]
    if _calls(alone["message"]):
        assert pieces[0]["id"] and pieces[0]["function"]["name"] == "get_weather"
        assert all(p.get("id") is None for p in pieces[1:])
        assert (
            "".join(p["function"].get("arguments") or "" for p in pieces)
            == _calls(alone["message"])[0]["arguments"]
        )
    reasons = [
        c["choices"][0]["finish_reason"]
        for c in chunks
        if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    assert reasons == [alone["finish_reason"]]
    # Both went through prefill + decode (the tool definitions make even the short one long).
    assert cluster.metric("tandem_router_requests_total", route="pd") == before + 2


def test_client_disconnect_aborts_both_workers(cluster: Cluster) -> None:
    body = {
        "model": MODEL,
        "messages": _long_chat("Write a long story."),
        "max_tokens": 3000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{cluster.router}/v1/chat/completions", json=body, timeout=60
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        seen = [next(lines) for _ in range(8)]
        assert any('"content"' in line for line in seen)
        assert wait_for(lambda: cluster.decode.load()["num_requests_in_flight"] == 1, timeout=10)
    for server in (cluster.decode, cluster.prefill):
        load = server.wait_idle()
        assert load["kv_blocks_used"] == 0 and load["num_requests_in_flight"] == 0
    with pytest.raises(httpx.ReadTimeout):  # a whole request whose client gives up
        httpx.post(
            f"{cluster.router}/v1/chat/completions", json={**body, "stream": False}, timeout=3.0
        )
    for server in (cluster.decode, cluster.prefill):
        load = server.wait_idle()
        assert load["kv_blocks_used"] == 0 and load["num_requests_in_flight"] == 0


def test_router_logs_one_line_per_request(cluster: Cluster) -> None:
    _post(
        cluster.router,
        "/v1/chat/completions",
        {"model": MODEL, "messages": _long_chat("Hello?"), "max_tokens": 4, "temperature": 0},
    )
    log = Path(cluster.router_log).read_text()
    assert re.search(
        r"chat whole route=pd \(long prompt\) prefill=http://\S+ decode=http://\S+ "
        r"prompt_tokens=\d+ ttft=\S+ e2e=\S+ retries=0 migrations=0 status=200",
        log,
    )


def test_killed_worker_is_marked_down_and_the_other_serves(
    cluster: Cluster, tmp_path: Any, start_router: Callable[..., str]
) -> None:
    spare = start_server(tmp_path / "spare.log", "--role", "both", *WORKER_ARGS)
    try:
        health = HealthPolicy(interval_s=0.2, timeout_s=1.0)
        both = start_router(
            [WorkerSpec(cluster.decode.url, "decode"), WorkerSpec(spare.url, "both")],
            health=health,
            pd_min_prompt_tokens=10**6,
            timeouts=MODEL_TIMEOUTS,
        )
        alone = start_router([WorkerSpec(spare.url, "both")], health=health, timeouts=MODEL_TIMEOUTS)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi!"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        expected = _text(_post(both, "/v1/chat/completions", body))
        for process in [
            *psutil.Process(spare.process.pid).children(recursive=True),
            psutil.Process(spare.process.pid),
        ]:
            process.kill()
        spare.process.wait(10)
        for _ in range(6):  # before and after the router notices, nothing fails
            assert _text(_post(both, "/v1/chat/completions", body)) == expected

        def spare_state() -> dict[str, Any]:
            workers = httpx.get(f"{both}/workers", timeout=10).json()["workers"]
            return next(w for w in workers if w["url"] == spare.url)

        assert wait_for(lambda: not spare_state()["healthy"], timeout=10)
        assert spare_state()["consecutive_failures"] >= 3
        reply = httpx.post(f"{alone}/v1/chat/completions", json=body, timeout=30)
        # Before the router notices, the dead worker refuses (502); after, no worker is up (503).
        codes = {502: "worker_unavailable", 503: "no_healthy_worker"}
        assert reply.status_code in codes, reply.text
        assert reply.json()["error"]["code"] == codes[reply.status_code], reply.text
        assert wait_for(
            lambda: httpx.get(f"{alone}/health", timeout=5).status_code == 503, timeout=10
        )
        reply = httpx.post(f"{alone}/v1/chat/completions", json=body, timeout=30)
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "no_healthy_worker"
    finally:
        stop_server(spare, signal.SIGKILL)
