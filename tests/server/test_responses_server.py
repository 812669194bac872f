"""`POST /v1/responses` and `GET /v1/responses/{id}` on a live `tandem serve`, through the
unmodified openai SDK (`client.responses.create`, `.stream`, `.retrieve`).

Text on the session's default-model server (greedy, so whole and streamed agree, and agree with
the same conversation asked through Chat Completions); function calls on Qwen2.5-Coder-0.5B,
whose template knows tools, in a server of this module's own.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tandem.loader.resolve import default_cache_dir
from tests.support.live_server import LiveServer, start_server, stop_server

MODEL = "smollm2-135m"
TOOL_MODEL = "qwen2.5-coder-0.5b"
TOOL_GGUF = default_cache_dir() / "models" / f"{TOOL_MODEL}.gguf"
BLOCK = 16
CONTEXT = ("You answer questions about cities, their history, food and weather briefly and precisely. "
           "You never invent facts and you say so when you do not know. ") * 3
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _nonce() -> str:
    return f"Ticket {uuid.uuid4().hex}."


@pytest.fixture(scope="module")
def client(tandem_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tandem_server}/v1", api_key="unused", max_retries=0, timeout=180)


def _tokens(url: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
    body: dict[str, Any] = {"messages": messages}
    if tools:
        body["tools"] = tools
    reply = httpx.post(f"{url}/tokenize", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["count"]


def _streamed(client: openai.OpenAI, ask: dict[str, Any]) -> Any:
    """The response a stream ends with, completed or cut short (the SDK's stream helper keeps
    only a completed one)."""
    events = list(client.responses.create(**ask, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
    return events[-1].response


def test_text_whole_streamed_and_raw_events_agree(client: openai.OpenAI, tandem_server: str) -> None:
    ask = {"model": MODEL, "instructions": "Answer in one short sentence.", "input": "Name three colours.",
           "max_output_tokens": 24, "temperature": 0}
    whole = client.responses.create(**ask)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.status in ("completed", "incomplete")
    assert whole.output_text and whole.output[0].type == "message" and whole.output[0].id.startswith("msg_")
    with client.responses.stream(**ask) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        streamed = stream.get_final_response()
    assert "".join(deltas) == streamed.output_text == whole.output_text
    assert streamed.status == whole.status
    assert (streamed.usage.input_tokens, streamed.usage.output_tokens) == (whole.usage.input_tokens,
                                                                           whole.usage.output_tokens)
    # The raw events, as Codex reads them: named, numbered, in order, ending with the response.
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{'completed' if whole.status == 'completed' else 'incomplete'}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == whole.output_text
    # The same conversation through Chat Completions: the same answer and usage.
    chat = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": ask["instructions"]}, {"role": "user", "content": ask["input"]}])
    assert chat.choices[0].message.content == whole.output_text
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                     chat.usage.completion_tokens)


def test_usage_is_exact_and_a_repeated_prompt_is_cached(client: openai.OpenAI, tandem_server: str) -> None:
    instructions = f"{_nonce()} {CONTEXT}"
    ask = {"model": MODEL, "instructions": instructions, "input": "What should I eat in Lisbon?",
           "max_output_tokens": 8, "temperature": 0}
    first = client.responses.create(**ask)
    prompt = _tokens(tandem_server, [{"role": "system", "content": instructions},
                                     {"role": "user", "content": ask["input"]}])
    usage = first.usage
    assert usage.input_tokens == prompt and usage.input_tokens_details.cached_tokens == 0
    assert 1 <= usage.output_tokens <= 8 and usage.total_tokens == prompt + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    again = _streamed(client, ask)
    assert again.usage.input_tokens == prompt and again.output_text == first.output_text
    cached = again.usage.input_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK == 0 and prompt - cached < 2 * BLOCK


def test_max_output_tokens_cuts_the_response_incomplete(client: openai.OpenAI) -> None:
    cut = client.responses.create(model=MODEL, input="Tell me a long story about a dragon.", max_output_tokens=3,
                                  temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.output[0].status == "incomplete"


def test_previous_response_id_continues_and_retrieve_reads_back(client: openai.OpenAI, tandem_server: str) -> None:
    opening = f"{_nonce()} My name is Ada. Say hello to me."
    first = client.responses.create(model=MODEL, input=opening, max_output_tokens=12, temperature=0)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = _streamed(client, {"model": MODEL, "previous_response_id": first.id, "input": "What is my name?",
                                "max_output_tokens": 12, "temperature": 0})
    assert second.previous_response_id == first.id
    conversation = [{"role": "user", "content": opening}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    assert second.usage.input_tokens == _tokens(tandem_server, conversation)
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prefix
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()


def test_store_false_and_unknown_ids_are_404(client: openai.OpenAI) -> None:
    gone = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert gone.store is False
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(gone.id)
    assert caught.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=gone.id)
    assert caught.value.body["code"] == "previous_response_not_found"
    assert caught.value.body["param"] == "previous_response_id"


def test_delete_forgets_a_stored_response(client: openai.OpenAI) -> None:
    kept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(kept.id).id == kept.id
    client.responses.delete(kept.id)  # the SDK's own call: DELETE /v1/responses/{id}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.delete(kept.id)
    assert caught.value.body["code"] == "response_not_found"


def test_hosted_tools_are_dropped_in_a_header_and_bad_input_is_a_400(client: openai.OpenAI) -> None:
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="Hi", max_output_tokens=2, store=False, reasoning={"summary": "auto"},
        include=["reasoning.encrypted_content"], prompt_cache_key="s",
        tools=[{"type": "web_search"}, {"type": "code_interpreter", "container": {"type": "auto"}}])
    assert raw.headers["x-tandem-ignored"] == "tool web_search, tool code_interpreter"
    assert raw.parse().status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"}]}])
    assert caught.value.body["param"] == "input[0].content[0]" and caught.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Hi", text={"format": {"type": "xml"}})
    assert caught.value.body["param"] == "text.format.type"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="Hi")


def test_the_server_stores_a_stream_before_its_last_events_go_out() -> None:
    """serving_protocol.protocol_events awaits the adapter's finish after the translator's
    closing events are made and before they are sent: a client that continues the moment it
    reads `response.completed` finds the response stored."""
    from tandem.edge.protocols.openai_responses import OpenAIResponsesAdapter
    from tandem.edge.protocols.response_store import MemoryResponseStore
    from tandem.server.serving_protocol import protocol_events

    adapter = OpenAIResponsesAdapter(MemoryResponseStore())
    seen: list[str] = []

    async def main() -> None:
        translated = await adapter.to_chat({"input": "x", "stream": True}, {})
        translator = adapter.stream(translated)
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}

        async def chunks() -> Any:
            yield {"model": MODEL, "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}
            yield {"model": MODEL, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
            yield {"model": MODEL, "choices": [], "usage": usage}

        async def stored() -> None:
            seen.append("stored" if translator.final else "nothing to store")
            await adapter.finish(translated, translator.final)

        async for event in protocol_events(chunks(), translator, lambda: seen.append("ended"), stored):
            seen.append(event.split("\n", 1)[0].removeprefix("event: "))
        assert (await adapter.retrieve(translated.response_id))["output"][0]["content"][0]["text"] == "Hi"

    asyncio.run(main())
    assert seen[-6:] == ["stored", "response.output_text.done", "response.content_part.done",
                         "response.output_item.done", "response.completed", "ended"]


# --- function calls, on a model that knows tools ------------------------------------------


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    assert TOOL_GGUF.is_file(), f"{TOOL_GGUF} is missing: run scripts/setup.sh (it assembles {TOOL_MODEL})"
    server = start_server(tmp_path_factory.mktemp("qwen") / "serve.log", TOOL_MODEL, "--kv-cache-memory", "512MiB",
                          "--max-num-seqs", "4")
    yield server
    assert not stop_server(server)


@pytest.fixture(scope="module")
def tool_client(tool_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def function_call_round_trip(client: openai.OpenAI, tools: list[dict[str, Any]], chat_name: str,
                             stream: bool) -> Any:
    """Turn 1 asks for the weather and gets a function_call; turn 2 sends it back with its
    output (Codex's way: the whole conversation each turn, store false). Turn 2 must be the
    chat request the same conversation makes: same prompt tokens, same answer."""
    question = {"role": "user", "content": "What is the weather in Tokyo right now?"}
    ask = {"model": TOOL_MODEL, "input": [question], "tools": tools, "temperature": 0, "max_output_tokens": 40,
           "store": False}
    if stream:
        events = list(client.responses.create(**ask, stream=True))
        first = events[-1].response
        kinds = [e.type for e in events]
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert "response.function_call_arguments.done" in kinds
        assert not any("<tool_call>" in e.delta for e in events if e.type == "response.output_text.delta")
    else:
        first = client.responses.create(**ask)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first.model_dump()
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    assert json.loads(call.arguments)["city"].lower().startswith("tokyo")
    if stream:
        assert deltas == call.arguments
    result = "18 degrees C and sunny"
    follow = client.responses.create(
        model=TOOL_MODEL, tools=tools, temperature=0, max_output_tokens=16, store=False,
        input=[question, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": result}])
    chat = client.chat.completions.create(
        model=TOOL_MODEL, temperature=0, max_tokens=16,
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"} | {"name": chat_name}}],
        messages=[question, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": chat_name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": result}])
    same_as_chat(follow, chat, "mcp__weather__")
    return call


def same_as_chat(response: Any, chat: Any, namespace: str = "") -> None:
    """A response is the chat completion of the same conversation: prompt, length, text, calls."""
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    message = chat.choices[0].message
    assert response.output_text == (message.content or "")
    assert [(c.name, c.arguments) for c in response.output if c.type == "function_call"] == \
        [(t.function.name.removeprefix(namespace), t.function.arguments) for t in message.tool_calls or []]
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_a_function_call_round_trip(tool_client: openai.OpenAI) -> None:
    call = function_call_round_trip(tool_client, [WEATHER], "get_weather", stream=True)
    assert call.namespace is None


def test_a_namespaced_function_is_called_back_with_its_namespace(tool_client: openai.OpenAI) -> None:
    tools = [{"type": "namespace", "name": "mcp__weather__", "description": "Weather tools",
              "tools": [{**WEATHER, "strict": False}]}, {"type": "web_search"}]
    call = function_call_round_trip(tool_client, tools, "mcp__weather__get_weather", stream=False)
    assert (call.name, call.namespace) == ("get_weather", "mcp__weather__")


def test_a_call_continued_by_previous_response_id(tool_client: openai.OpenAI, tool_server: LiveServer) -> None:
    first = tool_client.responses.create(model=TOOL_MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                         temperature=0, max_output_tokens=40)
    call = next(item for item in first.output if item.type == "function_call")
    second = tool_client.responses.create(
        model=TOOL_MODEL, previous_response_id=first.id, tools=[WEATHER], temperature=0, max_output_tokens=16,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees C, light rain"}])
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "21 degrees C, light rain"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    assert second.usage.input_tokens == _tokens(tool_server.url, messages, chat_tools)
    same_as_chat(second, tool_client.chat.completions.create(model=TOOL_MODEL, messages=messages, tools=chat_tools,
                                                             temperature=0, max_tokens=16))
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prefix
    assert tool_client.responses.retrieve(second.id).model_dump() == second.model_dump()

