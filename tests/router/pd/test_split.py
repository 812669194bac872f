"""When a request is split into prefill + decode hops, and the two hops' bodies."""

from __future__ import annotations

import pytest

from tandem.router.pd.split import (
    decide_route,
    decode_body,
    emit_first_token,
    prefill_body,
    prefill_outcome,
)


# --- when to split, and the hop bodies ---------------------------------------------------
@pytest.mark.parametrize(
    ("body", "kind", "tokens", "pd", "reason"),
    [
        ({"messages": []}, "chat", 1000, True, "long prompt"),
        ({"messages": []}, "chat", 100, False, "short prompt"),
        ({"messages": [], "n": 2}, "chat", 1000, False, "n>1"),
        ({"messages": [], "logprobs": True}, "chat", 1000, False, "logprobs"),
        ({"messages": [], "max_tokens": 1}, "chat", 1000, False, "max_tokens=1"),
        ({"prompt": "x", "logprobs": 0}, "completion", 1000, False, "logprobs"),
        ({"prompt": "x", "echo": True}, "completion", 1000, False, "echo"),
        ({"prompt": ["x", "y"]}, "completion", 1000, False, "several prompts"),
        ({"prompt": [1, 2, 3]}, "completion", 1000, True, "long prompt"),
    ],
)
def test_decide_route(body: dict, kind: str, tokens: int, pd: bool, reason: str) -> None:
    decision = decide_route(body, kind, tokens, 256, have_prefill=True)  # type: ignore[arg-type]
    assert (decision.pd, decision.reason) == (pd, reason)


def test_no_prefill_pool_means_whole_requests() -> None:
    assert decide_route({"messages": []}, "chat", 5000, 256, have_prefill=False).pd is False


def test_prefill_body() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_completion_tokens": 50,
        "stream_options": {"include_usage": True},
        "min_tokens": 5,
        "temperature": 0,
    }
    out = prefill_body(body, "http://decode:1")
    assert out["stream"] is False and out["max_tokens"] == 1 and out["min_tokens"] == 1
    assert "max_completion_tokens" not in out and "stream_options" not in out
    assert out["kv_transfer_params"] == {
        "do_remote_decode": True,
        "remote_decode": "http://decode:1",
    }
    assert (
        body["stream"] is True and body["max_completion_tokens"] == 50
    )  # the original is untouched


def test_decode_body_keeps_the_client_request_and_adds_the_handle() -> None:
    body = {"messages": [], "stream": True, "max_tokens": 20}
    out = decode_body(body, {"first_token_ids": [5], "transfer_id": "t"}, emit_first_token=False)
    assert out["max_tokens"] == 20 and out["stream"] is True
    assert out["stream_options"] == {"include_usage": True}  # the router always counts usage
    assert out["kv_transfer_params"] == {
        "first_token_ids": [5],
        "transfer_id": "t",
        "do_remote_prefill": True,
        "emit_first_token": False,
    }
    assert "kv_transfer_params" not in decode_body(body, None, True)


def test_emit_first_token_only_where_the_router_cannot_send_it_early() -> None:
    tool = {"type": "function", "function": {"name": "f"}}
    assert emit_first_token({"stream": False}) is True
    assert emit_first_token({"stream": True}) is False
    assert emit_first_token({"stream": True, "tools": [tool]}) is True
    assert emit_first_token({"stream": True, "tools": [tool], "tool_choice": "none"}) is False
    # Half a multi-byte character: the decode worker sends it whole with the next token.
    assert emit_first_token({"stream": True}, "caf\ufffd") is True
    assert emit_first_token({"stream": True}, "café") is False


def _prefill_reply(reason: str = "length", kv: object = "missing") -> dict:
    reply = {
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": reason}
        ],
        "usage": {
            "prompt_tokens": 300,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 256},
        },
    }
    if kv != "missing":
        reply["kv_transfer_params"] = kv
    return reply


def test_a_reasoning_workers_first_token_is_sent_by_the_decode_worker() -> None:
    """A worker with --reasoning-parser says `reasoning_content` (even null): where its first
    token belongs (reasoning or answer) only the decode worker's parser, reading on, can say."""
    body = {"messages": [], "max_tokens": 20}
    plain = prefill_outcome(_prefill_reply("length", {"transfer_id": "t"}), body, "chat")
    assert not plain.reasoning
    reply = _prefill_reply("length", {"transfer_id": "t"})
    reply["choices"][0]["message"]["reasoning_content"] = None
    assert prefill_outcome(reply, body, "chat").reasoning


def test_prefill_outcome() -> None:
    handle = {"first_token_ids": [9], "transfer_id": "t"}
    body = {"messages": [], "max_tokens": 20}
    going = prefill_outcome(_prefill_reply("length", handle), body, "chat")
    assert (
        going.takes_part and not going.complete and going.kv == handle and going.first_text == "Hi"
    )
    assert prefill_outcome(_prefill_reply("stop", None), body, "chat").complete  # EOS at once
    assert prefill_outcome(
        _prefill_reply("length", None), body, "chat"
    ).complete  # nothing to hand over
    assert prefill_outcome(_prefill_reply("length", handle), {"max_tokens": 1}, "chat").complete
    legacy = prefill_outcome(_prefill_reply("length"), body, "chat")
    assert not legacy.takes_part and not legacy.complete
