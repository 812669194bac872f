"""`tandem serve` through the official openai client, against a live server on the default model.

Everything here is greedy, so outputs are deterministic and can be compared between the
streamed and whole forms, and against the offline engine.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import openai
import pytest

from tandem.server.tool_parsers import get_tool_parser

MODEL = "smollm2-135m"
BLOCK = 16

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_PROMPT = [{"role": "user", "content": "Find the weather for Tokyo, please."}]


@pytest.fixture(scope="module")
def client(tandem_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tandem_server}/v1", api_key="unused", max_retries=0, timeout=120)


def _nonce() -> str:
    """A unique opening, so a prompt never meets blocks cached by another test."""
    return f"Ticket {uuid.uuid4().hex}."


def _prompt_len(url: str, prompt: str) -> int:
    return httpx.post(f"{url}/tokenize", json={"prompt": prompt}).json()["count"]


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_chat_matches_the_offline_engine(client: openai.OpenAI) -> None:
    from tandem import LLM, SamplingParams

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    offline = LLM(MODEL, kv_cache_memory="64MiB").chat(messages, SamplingParams(max_tokens=24, temperature=0))
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == offline[0].outputs[0].text
    assert choice.finish_reason == offline[0].outputs[0].finish_reason
    assert reply.usage.completion_tokens == len(offline[0].outputs[0].token_ids)
    assert reply.usage.prompt_tokens == len(offline[0].prompt_token_ids)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"


def test_chat_stream_equals_whole_response(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0, stream=True))
    assert all(c.choices for c in chunks)
    assert all(getattr(c, "usage", None) is None for c in chunks)


def test_completions_whole_and_streamed(client: openai.OpenAI) -> None:
    prompt = "The three primary colours are"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                              stream=True))
    assert whole.object == "text_completion"
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert whole.usage.completion_tokens == 20 and whole.choices[0].finish_reason == "length"


def test_completions_batch_of_prompts_and_token_ids(client: openai.OpenAI, tandem_server: str) -> None:
    prompts = ["One, two, three,", "Red, green,"]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    assert batch.choices[0].text == batch.choices[1].text == singles[0].choices[0].text
    assert batch.choices[2].text == singles[1].choices[0].text
    ids = httpx.post(f"{tandem_server}/tokenize", json={"prompt": prompts[0]}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == singles[0].choices[0].text


def test_echo_and_completion_logprobs(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, echo=True,
                                      logprobs=2)
    choice = reply.choices[0]
    assert choice.text.startswith("Hello")
    assert len(choice.logprobs.tokens) == 3 and len(choice.logprobs.top_logprobs[0]) == 2
    # Greedy: the sampled token is the most likely one.
    assert choice.logprobs.token_logprobs[0] == pytest.approx(max(choice.logprobs.top_logprobs[0].values()))


def test_cached_tokens_count_the_reused_prefix_exactly(client: openai.OpenAI, tandem_server: str) -> None:
    system = _nonce() + " You are a careful assistant who answers in one short sentence. " * 6
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is 2 + 2?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    prompt_len = second.usage.prompt_tokens
    # Whole blocks are cached, and the last prompt token is always computed (its logits are needed).
    assert second.usage.prompt_tokens_details.cached_tokens == (prompt_len - 1) // BLOCK * BLOCK
    assert second.choices[0].message.content == first.choices[0].message.content

    # A different question after the same system prompt reuses the shared blocks only.
    other = [messages[0], {"role": "user", "content": "Name a large animal."}]
    third = list(client.chat.completions.create(model=MODEL, messages=other, max_tokens=4, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    mine = httpx.post(f"{tandem_server}/tokenize", json={"messages": messages}).json()["tokens"]
    theirs = httpx.post(f"{tandem_server}/tokenize", json={"messages": other}).json()["tokens"]
    common = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b)
    assert third[-1].usage.prompt_tokens == len(theirs)
    assert third[-1].usage.prompt_tokens_details.cached_tokens == common // BLOCK * BLOCK


def test_chat_content_as_list_of_parts(client: openai.OpenAI) -> None:
    as_text = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
    as_parts = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
        max_tokens=8, temperature=0)
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content


def test_stop_string_is_not_emitted(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    free = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert "Paris" in free.choices[0].message.content
    stopped = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                             stop=["Paris"])
    expected = free.choices[0].message.content.split("Paris")[0]
    assert stopped.choices[0].message.content == expected
    assert stopped.choices[0].finish_reason == "stop"
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                   temperature=0, stop=["Paris"], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected


def test_n_seed_and_chat_logprobs(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me a word."}]
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2}
    first = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=3)
    again = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    content = first.choices[0].logprobs.content
    assert sum(len(c.logprobs.content) for c in first.choices) == first.usage.completion_tokens
    assert all(len(item.top_logprobs) == 3 for item in content)
    assert "".join(item.token for item in content) == first.choices[0].message.content


def test_named_tool_choice_returns_a_parsed_call(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model=MODEL, messages=TOOL_PROMPT, tools=[WEATHER_TOOL],
                                           tool_choice=choice, max_tokens=60, temperature=0)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)

    chunks = list(client.chat.completions.create(model=MODEL, messages=TOOL_PROMPT, tools=[WEATHER_TOOL],
                                                 tool_choice=choice, max_tokens=60, temperature=0, stream=True))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].id and pieces[0].function.name == "get_weather" and pieces[0].type == "function"
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    streamed_content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed_content == (message.content or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_none_and_tool_history(client: openai.OpenAI) -> None:
    none = client.chat.completions.create(model=MODEL, messages=TOOL_PROMPT, tools=[WEATHER_TOOL],
                                          tool_choice="none", max_tokens=16, temperature=0)
    assert not none.choices[0].message.tool_calls and "<tool_call>" not in (none.choices[0].message.content or "")
    _assert_finish_reason_fits(none, 16)

    history = [
        *TOOL_PROMPT,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Tokyo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21, "sky": "clear"}'},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL],
                                           max_tokens=24, temperature=0)
    _assert_finish_reason_fits(reply, 24)
    again = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL],
                                           max_tokens=24, temperature=0)
    assert again.choices[0].message == reply.choices[0].message  # greedy: the same answer


def _assert_finish_reason_fits(reply: Any, max_tokens: int) -> None:
    """The finish reason says what happened: a call, the token limit, or a natural stop."""
    choice = reply.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
    elif reply.usage.completion_tokens == max_tokens:
        assert choice.finish_reason == "length"
    else:
        assert choice.finish_reason == "stop"


def test_tool_history_reaches_the_prompt(tandem_server: str) -> None:
    """The plain SmolLM2 template gets tools, earlier calls and results in the Hermes format."""
    history = [
        *TOOL_PROMPT,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Tokyo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and clear"},
    ]
    with_tools = httpx.post(f"{tandem_server}/tokenize", json={"messages": history}).json()["tokens"]
    text = httpx.post(f"{tandem_server}/detokenize", json={"tokens": with_tools}).json()["prompt"]
    parser = get_tool_parser("hermes")
    assert parser.render_tool_calls([{"function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]) in text
    assert parser.render_tool_result("21 C and clear", "get_weather") in text


def test_tokenize_detokenize_round_trip(tandem_server: str) -> None:
    text = "Paged attention, prefix caching — and UTF-8: naïve café 東京."
    tokens = httpx.post(f"{tandem_server}/tokenize", json={"prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    back = httpx.post(f"{tandem_server}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back["prompt"] == text


def test_cache_salt_isolates_prompt_caches(client: openai.OpenAI) -> None:
    """Requests share cached blocks only under the same cache_salt (vLLM's field)."""
    messages = [{"role": "user", "content": f"[{uuid.uuid4().hex}] " + "Tell me about salt. " * 10}]

    def cached(salt: str) -> tuple[int, int]:
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                               extra_body={"cache_salt": salt})
        return reply.usage.prompt_tokens_details.cached_tokens, reply.usage.prompt_tokens

    assert cached("tenant-a")[0] == 0  # nothing under this salt yet, not even the system prompt
    hit, prompt_tokens = cached("tenant-a")
    assert hit == (prompt_tokens - 1) // 16 * 16  # every whole block short of the last token
    assert cached("tenant-b")[0] == 0  # the same prompt, another tenant
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body={"cache_salt": ""})


def test_health_load_and_metrics(tandem_server: str, client: openai.OpenAI) -> None:
    before = _samples(httpx.get(f"{tandem_server}/metrics").text)
    hello = [{"role": "user", "content": "Hi there! " * 12}]  # two whole blocks and more
    first = client.chat.completions.create(model=MODEL, messages=hello, max_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
    second = client.chat.completions.create(model=MODEL, messages=hello, max_tokens=3, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert httpx.get(f"{tandem_server}/health").status_code == 200
    load = httpx.get(f"{tandem_server}/load").json()
    for key in ("num_waiting_requests", "num_waiting_prefill_tokens", "num_running_requests",
                "kv_blocks_used", "kv_blocks_total"):
        assert isinstance(load[key], int)
    assert load["kv_blocks_total"] > 0
    samples = _samples(httpx.get(f"{tandem_server}/metrics").text)
    model = f'{{model_name="{MODEL}"}}'

    def grew(name: str) -> float:
        key = f"tandem:{name}{model}"
        return samples[key] - before.get(key, 0.0)

    assert grew("time_to_first_token_seconds_count") == 2
    assert grew("e2e_request_latency_seconds_count") == 2
    assert grew("request_queue_time_seconds_count") == 2
    assert grew("inter_token_latency_seconds_count") == 4  # 3 tokens: 2 gaps each
    assert grew("generation_tokens_total") == 6
    assert grew("prompt_tokens_total") == 2 * second.usage.prompt_tokens
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, second)]
    assert cached[1] > cached[0]  # the second request hit the first's blocks
    assert grew("prefix_cache_hits_total") == sum(cached)
    assert grew("prefix_cache_queries_total") == 2 * second.usage.prompt_tokens
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert samples[f"tandem:{name}{model}"] == 0.0  # idle again


def _samples(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_tokenize_renders_chat_fields_like_a_chat_request(tandem_server: str) -> None:
    """Routers hash these tokens to find cached prefixes: they must be the served prompt's."""
    url = tandem_server
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    plain = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    continued = httpx.post(f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                                   "continue_final_message": True}).json()["tokens"]
    text = httpx.post(f"{url}/detokenize", json={"tokens": continued}).json()["prompt"]
    assert text.endswith("Hello, I am") and continued != plain
    with_tools = httpx.post(f"{url}/tokenize", json={"messages": TOOL_PROMPT, "tools": [WEATHER_TOOL]}).json()
    without = httpx.post(f"{url}/tokenize", json={"messages": TOOL_PROMPT}).json()
    assert with_tools["count"] > without["count"]  # the tools went into the system message
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": TOOL_PROMPT, "tools": [WEATHER_TOOL], "max_tokens": 1}).json()
    assert reply["usage"]["prompt_tokens"] == with_tools["count"]
