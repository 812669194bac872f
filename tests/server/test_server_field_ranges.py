"""Every number a client sends is range-checked at the edge: out of range is a 400 in OpenAI's
shape naming the field, never an overflow in the engine (tandem/edge/openai_protocol.py, and the
vocabulary-bound checks in ServingState.sampling_params). The attack replays that motivated
this are in tests/security/test_hostile_params.py.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.live_server import LiveServer

MODEL = "smollm2-135m"
VOCAB = 49152  # SmolLM2's vocabulary
HELLO = [{"role": "user", "content": "Hello"}]
CHAT = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}

# (case, path, extra fields, the error's param)
OUT_OF_RANGE: list[tuple[str, str, dict[str, Any], str]] = [
    ("top_k above the vocabulary", "/v1/chat/completions", {"top_k": VOCAB + 1, "temperature": 0.8}, "top_k"),
    ("top_k -2", "/v1/chat/completions", {"top_k": -2}, "top_k"),
    ("seed 2**63", "/v1/chat/completions", {"seed": 2**63}, "seed"),
    ("seed below int64", "/v1/completions", {"seed": -(2**63) - 1}, "seed"),
    ("stop_token_ids at the vocabulary", "/v1/completions", {"stop_token_ids": [0, VOCAB]}, "stop_token_ids"),
    ("stop_token_ids negative", "/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids.0"),
    ("stop_token_ids too many", "/v1/completions", {"stop_token_ids": list(range(1025))}, "stop_token_ids"),
    ("min_tokens 2**31", "/v1/completions", {"min_tokens": 2**31}, "min_tokens"),
    ("min_tokens negative", "/v1/chat/completions", {"min_tokens": -1}, "min_tokens"),
    ("max_tokens 2**63", "/v1/completions", {"max_tokens": 2**63}, "max_tokens"),
    ("max_completion_tokens 2**31", "/v1/chat/completions", {"max_completion_tokens": 2**31},
     "max_completion_tokens"),
    ("min_p 1.5", "/v1/chat/completions", {"min_p": 1.5}, "min_p"),
    ("top_p 0", "/v1/chat/completions", {"top_p": 0}, "top_p"),
    ("repetition_penalty 0", "/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("presence_penalty 3", "/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("frequency_penalty -3", "/v1/chat/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("temperature inf string", "/v1/chat/completions", {"temperature": "inf"}, "temperature"),
    ("logit_bias NaN string", "/v1/chat/completions", {"logit_bias": {"11": "NaN"}}, "logit_bias.11"),
]


@pytest.mark.parametrize(("case", "path", "fields", "param"), OUT_OF_RANGE, ids=[c[0] for c in OUT_OF_RANGE])
def test_out_of_range_field_is_a_400_naming_it(tandem_server: str, case: str, path: str,
                                               fields: dict[str, Any], param: str) -> None:
    base = CHAT if path == "/v1/chat/completions" else COMPLETION
    response = httpx.post(f"{tandem_server}{path}", json={**base, **fields}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
    assert error["param"] == param and param.split(".")[0] in error["message"], error


def test_top_k_past_the_vocabulary_says_what_is_allowed(tandem_server: str) -> None:
    response = httpx.post(f"{tandem_server}/v1/completions", timeout=60,
                          json={**COMPLETION, "top_k": 2**63, "temperature": 0.8})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(
        f"top_k must be at most the vocabulary size ({VOCAB}), or -1/0 to disable")


def test_fields_at_their_bounds_run(tandem_server_process: LiveServer) -> None:
    url = tandem_server_process.url
    edges = [
        {"top_k": VOCAB, "temperature": 0.8, "seed": 2**63 - 1},
        {"top_k": -1, "temperature": 0.8, "seed": -(2**63), "n": 2},
        {"stop_token_ids": [0, VOCAB - 1], "min_tokens": 1, "min_p": 1, "top_p": 1},
        {"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 1e-30, "temperature": 0.8},
    ]
    for fields in edges:
        response = httpx.post(f"{url}/v1/completions", json={**COMPLETION, **fields}, timeout=60)
        assert response.status_code == 200, (fields, response.text)
    assert tandem_server_process.wait_idle()["kv_blocks_used"] == 0


def test_a_surrogate_pair_is_one_character(tandem_server: str) -> None:
    """An emoji sent as a JSON surrogate pair (\\ud83d\\ude00) passes the lone-surrogate check and
    tokenizes as the character itself."""
    escaped = httpx.post(f"{tandem_server}/tokenize", content=b'{"prompt": "Smile \\ud83d\\ude00"}',
                         headers={"content-type": "application/json"}, timeout=30)
    assert escaped.status_code == 200, escaped.text
    literal = httpx.post(f"{tandem_server}/tokenize", json={"prompt": "Smile \U0001f600"}, timeout=30)
    assert escaped.json()["tokens"] == literal.json()["tokens"]
    chat = httpx.post(f"{tandem_server}/v1/chat/completions", timeout=60,
                      content=b'{"model": "smollm2-135m", "max_tokens": 2, '
                              b'"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}',
                      headers={"content-type": "application/json"})
    assert chat.status_code == 200, chat.text
