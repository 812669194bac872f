"""Merging two workers' halves into one response: ids, tokens in order, usage counted once."""

from __future__ import annotations

from tandem.router.pd.merge import (
    ChunkRewriter,
    Identity,
    merged_usage,
    reply_to_chunks,
    rewrite_reply,
)

# --- merging ---------------------------------------------------------------------------
IDENT = Identity("chatcmpl-router", 1234, "smollm2-135m", "chat")

# A decode worker's stream as recorded (emit_first_token false: it starts after the first token).
DECODE_CHUNKS = [
    {
        "id": "chatcmpl-w",
        "object": "chat.completion.chunk",
        "created": 99,
        "model": "smollm2-135m",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "usage": None,
    },
    {
        "id": "chatcmpl-w",
        "object": "chat.completion.chunk",
        "created": 99,
        "model": "smollm2-135m",
        "choices": [
            {"index": 0, "delta": {"content": " world"}, "logprobs": None, "finish_reason": None}
        ],
        "usage": None,
    },
    {
        "id": "chatcmpl-w",
        "object": "chat.completion.chunk",
        "created": 99,
        "model": "smollm2-135m",
        "choices": [
            {"index": 0, "delta": {"content": "!"}, "logprobs": None, "finish_reason": "stop"}
        ],
        "usage": None,
    },
    {
        "id": "chatcmpl-w",
        "object": "chat.completion.chunk",
        "created": 99,
        "model": "smollm2-135m",
        "choices": [],
        "usage": {
            "prompt_tokens": 300,
            "completion_tokens": 3,
            "total_tokens": 303,
            "prompt_tokens_details": {"cached_tokens": 300},
        },
    },
]
PREFILL_USAGE = {
    "prompt_tokens": 300,
    "completion_tokens": 1,
    "total_tokens": 301,
    "prompt_tokens_details": {"cached_tokens": 256},
}


def test_stream_merge_with_usage() -> None:
    rewrite = ChunkRewriter(IDENT, include_usage=True, drop_role=True, prefill_usage=PREFILL_USAGE)
    out = [c for c in (rewrite(dict(chunk)) for chunk in DECODE_CHUNKS) if c is not None]
    assert len(out) == 3  # the worker's role chunk is gone: the router sent its own
    assert {(c["id"], c["created"]) for c in out} == {("chatcmpl-router", 1234)}
    assert [c["choices"][0]["delta"].get("content") for c in out[:2]] == [" world", "!"]
    assert out[1]["choices"][0]["finish_reason"] == "stop" and rewrite.finish_reason == "stop"
    usage = out[2]["usage"]
    # Prompt and cached from the prefill hop (the decode worker's cache hits are the blocks
    # it was just sent), completion from the decode hop, which counts the first token.
    assert usage == {
        "prompt_tokens": 300,
        "completion_tokens": 3,
        "total_tokens": 303,
        "prompt_tokens_details": {"cached_tokens": 256},
    }
    assert all("usage" in c for c in out)


def test_stream_merge_without_usage_strips_it() -> None:
    rewrite = ChunkRewriter(IDENT, include_usage=False, drop_role=False)
    out = [c for c in (rewrite(dict(chunk)) for chunk in DECODE_CHUNKS) if c is not None]
    assert len(out) == 3 and out[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("usage" not in c for c in out)
    assert rewrite.usage is not None and rewrite.usage["completion_tokens"] == 3  # still counted


def test_merged_usage_counts_cached_tokens_once() -> None:
    decode = {
        "prompt_tokens": 300,
        "completion_tokens": 10,
        "total_tokens": 310,
        "prompt_tokens_details": {"cached_tokens": 300},
    }
    merged = merged_usage(PREFILL_USAGE, decode)
    assert merged["prompt_tokens_details"]["cached_tokens"] == 256
    assert merged["total_tokens"] == 310 and merged["completion_tokens"] == 10
    assert merged_usage(None, decode) == decode


def test_whole_reply_rewrite() -> None:
    reply = {
        "id": "chatcmpl-w",
        "object": "chat.completion",
        "created": 5,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi world!"},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 300,
            "completion_tokens": 3,
            "total_tokens": 303,
            "prompt_tokens_details": {"cached_tokens": 300},
        },
        "kv_transfer_params": {"adopted_blocks": 18},
    }
    out = rewrite_reply(reply, IDENT, PREFILL_USAGE)
    assert (
        out["id"] == "chatcmpl-router" and out["created"] == 1234 and out["model"] == "smollm2-135m"
    )
    assert "kv_transfer_params" not in out
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
    assert reply["id"] == "chatcmpl-w"  # not mutated


def test_reply_to_chunks_keeps_tool_calls() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'},
    }
    reply = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
    }
    chunks = reply_to_chunks(reply, IDENT, include_usage=True)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pieces = chunks[1]["choices"][0]["delta"]["tool_calls"]
    assert pieces == [
        {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'},
        }
    ]
    assert chunks[2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 1
    assert {c["id"] for c in chunks} == {"chatcmpl-router"}


def test_reply_to_chunks_keeps_the_matched_stop() -> None:
    """A reply the prefill worker finished, streamed: its end still names the stop string
    (vLLM's `stop_reason`), which a Messages stream reports as its `stop_sequence`."""
    reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                          "finish_reason": "stop", "stop_reason": "END"}]}
    chunks = reply_to_chunks(reply, IDENT, include_usage=False)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == "END"


def test_reply_to_chunks_for_completions() -> None:
    ident = Identity("cmpl-router", 1, "m", "completion")
    reply = {
        "choices": [{"index": 0, "text": " Paris", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3},
    }
    chunks = reply_to_chunks(reply, ident, include_usage=False)
    assert len(chunks) == 1 and chunks[0]["choices"][0]["text"] == " Paris"
    assert chunks[0]["object"] == "text_completion" and "usage" not in chunks[0]
