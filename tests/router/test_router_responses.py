"""`/v1/responses` through `tandem route`, with the unmodified openai SDK, on every path.

Two router replicas (`python -m tandem route`, as a user starts them) in front of one prefill and
one decode `tandem serve` (default model), sharing one Redis response store (a real
redis-server with the cluster secret as its password, as `tandem up` runs it): short prompts go
whole to the decode worker (direct), longer ones are split (PD). Greedy answers must equal the
session's lone `tandem serve`, usage must be exact, and a conversation stored by one replica
continues on the other. A third router in front of a Qwen2.5-Coder worker (a template that
knows tools) carries a function-call round trip, and shares the store too.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tandem.cli.main import build_parser
from tandem.launch.cluster_plan import plan_cluster
from tandem.launch.redis_server import RedisServer
from tandem.loader.resolve import default_cache_dir, resolve_model
from tandem.router.cli import check_route
from tests.support.live_server import (
    TEST_SECRET,
    LiveServer,
    start_router,
    start_server,
    stop_server,
)
from tests.support.router_helpers import metric

MODEL = "smollm2-135m"
TOOL_MODEL = "qwen2.5-coder-0.5b"
TOOL_GGUF = default_cache_dir() / "models" / f"{TOOL_MODEL}.gguf"
# Blocks of 16 tokens, as the session's server (tests/conftest.py) that the answers are compared with.
WORKER_ARGS = ("--kv-cache-memory", "256MiB", "--threads", "1", "--max-num-seqs", "16", "--block-size", "16")
PD_MIN = 32
CONTEXT = ("You are a helpful assistant for a travel agency. You answer questions about cities, "
           "their history, food and weather briefly and precisely. ") * 5
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@dataclass
class Routers:
    prefill: LiveServer
    decode: LiveServer
    a: str  # two replicas over the same workers and store
    b: str
    redis: RedisServer

    def client(self, url: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=240)

    def requests(self, url: str, route: str) -> float:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        return metric(text, "tandem_router_requests_total", route=route, endpoint="responses")


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def routers(tmp_path_factory: pytest.TempPathFactory, redis_binary: str) -> Iterator[Routers]:
    logs = tmp_path_factory.mktemp("router-responses")
    servers: list[LiveServer] = []
    processes: list[subprocess.Popen[bytes]] = []
    redis = RedisServer(password=TEST_SECRET, log_path=logs / "redis.log").start()
    try:
        servers.append(start_server(logs / "prefill.log", "--role", "prefill", *WORKER_ARGS, secret=TEST_SECRET))
        servers.append(start_server(logs / "decode.log", "--role", "decode", *WORKER_ARGS, secret=TEST_SECRET))
        tokenizer = resolve_model(MODEL, "float32").hf_dir
        urls = []
        for name in ("a", "b"):
            url, process = start_router(
                logs / f"router-{name}.log", "--prefill", servers[0].url, "--decode", servers[1].url,
                "--tokenizer", str(tokenizer), "--pd-min-prompt-tokens", str(PD_MIN), "--no-ledger",
                "--response-store", redis.url, secret=TEST_SECRET)
            urls.append(url)
            processes.append(process)
        yield Routers(servers[0], servers[1], urls[0], urls[1], redis)
    finally:
        _stop(processes)
        for server in servers:
            assert not stop_server(server)
        redis.stop()


def _nonce() -> str:
    return f"Ticket {uuid.uuid4().hex[:12]}."


def _ask(route: str) -> dict[str, Any]:
    if route == "pd":
        return {"model": MODEL, "instructions": f"{_nonce()} {CONTEXT}", "input": "What should I eat in Lisbon?",
                "max_output_tokens": 16, "temperature": 0}
    return {"model": MODEL, "input": "Hi! Who are you?", "max_output_tokens": 16, "temperature": 0}


def _final(client: openai.OpenAI, ask: dict[str, Any], stream: bool) -> Any:
    if not stream:
        return client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text
    return events[-1].response


def _tokens(worker: LiveServer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
    body: dict[str, Any] = {"messages": messages, **({"tools": tools} if tools else {})}
    reply = worker.post("/tokenize", body)  # signed: the worker answers its router's peers only
    assert reply.status_code == 200, reply.text
    return reply.json()["count"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("route", ["direct", "pd"])
def test_greedy_answers_equal_one_worker(routers: Routers, tandem_server: str, route: str, stream: bool) -> None:
    ask = _ask(route)
    before = routers.requests(routers.a, route)
    pulled = routers.decode.load()["kv_transfer"]["blocks_received"]
    response = _final(routers.client(routers.a), ask, stream)
    alone = routers.client(tandem_server).responses.create(**ask)
    assert response.output_text == alone.output_text and response.status == alone.status
    assert (response.usage.input_tokens, response.usage.output_tokens) == (alone.usage.input_tokens,
                                                                           alone.usage.output_tokens)
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    messages = ([{"role": "system", "content": ask["instructions"]}] if "instructions" in ask else []) + [
        {"role": "user", "content": ask["input"]}]
    assert response.usage.input_tokens == _tokens(routers.decode, messages)
    assert routers.requests(routers.a, route) == before + 1
    if route == "pd":  # the decode worker really fetched the prompt's KV
        assert routers.decode.load()["kv_transfer"]["blocks_received"] > pulled


def test_a_repeated_prompt_is_cached_through_pd(routers: Routers) -> None:
    ask = _ask("pd")
    client = routers.client(routers.a)
    first = client.responses.create(**ask)
    again = _final(client, ask, stream=True)
    assert again.output_text == first.output_text and again.usage.input_tokens == first.usage.input_tokens
    cached = again.usage.input_tokens_details.cached_tokens
    assert cached > 0 and first.usage.input_tokens - cached < 32


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_one_replica_continues_what_the_other_stored(routers: Routers, stream: bool) -> None:
    a, b = routers.client(routers.a), routers.client(routers.b)
    ask = _ask("pd")
    first = _final(a, ask, stream)
    assert b.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = _final(b, {"model": MODEL, "previous_response_id": first.id, "input": "And in Porto?",
                        "max_output_tokens": 12, "temperature": 0}, stream)
    assert second.previous_response_id == first.id and second.instructions is None
    conversation = [{"role": "user", "content": ask["input"]}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And in Porto?"}]
    assert second.usage.input_tokens == _tokens(routers.decode, conversation)
    assert a.responses.retrieve(second.id).model_dump() == second.model_dump()


def test_store_false_is_not_kept_by_any_replica(routers: Routers) -> None:
    a, b = routers.client(routers.a), routers.client(routers.b)
    gone = a.responses.create(**_ask("direct"), store=False)
    for client in (a, b):
        with pytest.raises(openai.NotFoundError) as caught:
            client.responses.retrieve(gone.id)
        assert caught.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as caught:
        b.responses.create(model=MODEL, input="Hi", previous_response_id=gone.id)
    assert caught.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        a.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}])
    assert caught.value.body["param"] == "input[0].content[0]"


# --- a function call through a router, on a model that knows tools ---------------------------


@pytest.fixture(scope="module")
def tool_router(routers: Routers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, LiveServer]]:
    assert TOOL_GGUF.is_file(), f"{TOOL_GGUF} is missing: run scripts/setup.sh (it assembles {TOOL_MODEL})"
    logs = tmp_path_factory.mktemp("router-responses-tools")
    worker = start_server(logs / "qwen.log", TOOL_MODEL, "--kv-cache-memory", "512MiB", "--max-num-seqs", "4",
                          secret=TEST_SECRET)
    process = None
    try:
        url, process = start_router(logs / "router-c.log", "--worker", worker.url, "--no-ledger",
                                    "--response-store", routers.redis.url, secret=TEST_SECRET)
        yield url, worker
    finally:
        if process is not None:
            _stop([process])
        assert not stop_server(worker)


def test_a_function_call_round_trip_through_a_router(routers: Routers, tool_router: tuple[str, LiveServer]) -> None:
    url, worker = tool_router
    client = routers.client(url)
    tools = [{"type": "namespace", "name": "mcp__weather__", "description": "Weather tools",
              "tools": [{**WEATHER, "strict": False}]}, {"type": "web_search"}]
    with client.responses.with_streaming_response.create(
            model=TOOL_MODEL, input="What is the weather in Tokyo right now?", tools=tools, temperature=0,
            max_output_tokens=40, stream=True, extra_headers={"session-id": "codex-session-1"}) as raw:
        assert raw.headers["x-tandem-ignored"] == "tool web_search"
        events = list(raw.parse())
    first = events[-1].response
    call = next(item for item in first.output if item.type == "function_call")
    assert (call.name, call.namespace) == ("get_weather", "mcp__weather__")
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    assert not any(e.type == "response.output_text.delta" and "<tool_call>" in e.delta for e in events)
    second = client.responses.create(
        model=TOOL_MODEL, previous_response_id=first.id, tools=tools, temperature=0, max_output_tokens=16,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees C and sunny"}])
    chat_tool = {"type": "function", "function": {"name": "mcp__weather__get_weather",
                                                  "description": WEATHER["description"],
                                                  "parameters": WEATHER["parameters"]}}
    messages = [{"role": "user", "content": "What is the weather in Tokyo right now?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": "mcp__weather__get_weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees C and sunny"}]
    assert second.usage.input_tokens == _tokens(worker, messages, [chat_tool])
    assert second.usage.input_tokens_details.cached_tokens > 0
    # Stored by this router, read back by the others: one store for the cluster.
    assert routers.client(routers.b).responses.retrieve(second.id).model_dump() == second.model_dump()


# --- flags -------------------------------------------------------------------------------------


def test_route_refuses_a_response_store_it_cannot_open() -> None:
    parser = build_parser()
    args = parser.parse_args(["route", "--worker", "http://127.0.0.1:1", "--response-store", "mooncake://m:1"])
    with pytest.raises(ValueError, match="response-store"):
        check_route(args)
    args = parser.parse_args(["route", "--worker", "http://127.0.0.1:1"])
    assert check_route(args).response_store == "memory"
    args = parser.parse_args(["route", "--worker", "http://127.0.0.1:1", "--response-store", "valkey://h:1"])
    assert check_route(args).response_store == "valkey://h:1"


def test_tandem_up_gives_the_router_its_redis(tmp_path: Path) -> None:
    def router_argv(*argv: str) -> list[str]:
        args = build_parser().parse_args(["up", "--log-dir", str(tmp_path), *argv])
        ports = iter(range(9300, 9400))
        return list(plan_cluster(args, None, free_port=lambda: next(ports), secret="s").router.argv)

    argv = router_argv("--kv-store", "redis://10.0.0.5:6379")
    assert argv[argv.index("--response-store") + 1] == "redis://10.0.0.5:6379"
    assert "--response-store" not in router_argv()
    assert "--response-store" not in router_argv("--kv-store", "mooncake://10.0.0.5:50051")
