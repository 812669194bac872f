"""Attack replays: request fields that used to kill the engine or answer 500, each now a 400.

The report these replay: top_k 2**63 (an int64 overflow in the sampler's top-k tensor) and a
seed of 2**70 (torch.Generator.manual_seed) killed the engine core, so the worker answered
503 engine_dead and exited; NaN / Infinity temperature or repetition_penalty (JSON literals,
which Python's json accepts, or strings, which pydantic's lax floats accept) answered 200
with empty output; a lone UTF-16 surrogate ("\\ud800") answered 500 on the worker (chat,
completions, /tokenize) and on the router. The fixes: range checks at the edge
(tandem/edge/openai_protocol.py), the same inside SamplingParams.validate, a sampler that clamps
what gets past them (tandem/layers/sampler.py), and the surrogate check in
tandem/edge/limits.py's middleware, which the worker and the router both run.

The live replays use the session's `tandem serve` (tests/conftest.py): after all of them the
worker must answer an ordinary greedy request with the same text as before, be healthy, and
hold no KV block once idle.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from tandem.config import RequestLimits
from tandem.edge.limits import RequestLimitMiddleware, holds_lone_surrogate
from tandem.edge.openai_protocol import ChatCompletionRequest, CompletionRequest
from tandem.layers.sampler import Sampler, SamplingRow
from tandem.types import SEED_MAX, SEED_MIN, SamplingParams
from tests.support.live_server import LiveServer, start_router

MODEL = "smollm2-135m"
VOCAB = 49152  # SmolLM2's vocabulary
HELLO = '[{"role": "user", "content": "Hello"}]'
GREEDY = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}],
          "max_tokens": 8, "temperature": 0}


# --- SamplingParams.validate: the engine's own checks -------------------------------------------
@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty",
                                   "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_validate_refuses_non_finite_floats(field: str, value: float) -> None:
    params = SamplingParams()
    setattr(params, field, value)
    with pytest.raises(ValueError, match=f"^{field} must be a finite number"):
        params.validate()


@pytest.mark.parametrize("seed", [SEED_MAX + 1, SEED_MIN - 1, 2**70, -(2**70)])
def test_validate_refuses_seeds_past_int64(seed: int) -> None:
    with pytest.raises(ValueError, match="^seed must be in"):
        SamplingParams(seed=seed)


def test_seeds_at_the_int64_bounds_are_valid() -> None:
    for seed in (SEED_MIN, SEED_MAX, 0, -1):
        SamplingParams(seed=seed).validate(vocab_size=VOCAB)
        torch.Generator().manual_seed(seed)


def test_validate_with_a_vocabulary_bounds_top_k_and_stop_token_ids() -> None:
    SamplingParams(temperature=0.8, top_k=VOCAB, stop_token_ids=[0, VOCAB - 1]).validate(vocab_size=VOCAB)
    with pytest.raises(ValueError, match=rf"^top_k must be at most the vocabulary size \({VOCAB}\), or -1/0"):
        SamplingParams(top_k=VOCAB + 1).validate(vocab_size=VOCAB)
    with pytest.raises(ValueError, match="^top_k must be at most"):
        SamplingParams(top_k=2**63).validate(vocab_size=VOCAB)
    for bad in (VOCAB, -1, 2**70, -(2**70)):
        with pytest.raises(ValueError, match=rf"^stop_token_ids must be token ids in \[0, {VOCAB}\), got {bad}"):
            SamplingParams(stop_token_ids=[3, bad]).validate(vocab_size=VOCAB)
    # Without a vocabulary the method checks what it always did: no bound on either.
    SamplingParams(top_k=2**63, stop_token_ids=[2**70]).validate()
    assert SamplingParams(top_k=-1).top_k == 0


def test_for_child_keeps_the_seed_in_int64_and_the_generator_unchanged() -> None:
    for seed in (SEED_MAX, SEED_MAX - 1, SEED_MIN, -1):
        parent = SamplingParams(n=4, seed=seed)
        children = [parent.for_child(i) for i in range(4)]
        seeds = [c.seed for c in children]
        assert all(s is not None and SEED_MIN <= s <= SEED_MAX for s in seeds), seeds
        assert len(set(seeds)) == 4
        for index, child in enumerate(children):
            assert child.n == 1
            # torch reads seeds modulo 2**64: the wrapped seed is the generator seed + index was.
            wrapped = torch.Generator().manual_seed(child.seed)  # type: ignore[arg-type]
            assert wrapped.initial_seed() == (seed + index) % 2**64
    assert SamplingParams(n=2, seed=5).for_child(1).seed == 6
    assert SamplingParams(n=2).for_child(1).seed is None


# --- the sampler: what gets past the checks cannot crash it or make NaN ------------------------
def _row(**fields: Any) -> SamplingRow:
    return SamplingRow(SamplingParams(**fields), list(range(0, 64, 2)), [1, 3, 5])


def test_sampler_clamps_top_k_to_the_vocabulary() -> None:
    logits = torch.randn(3, 64)
    rows = [_row(temperature=0.8, top_k=2**63), _row(temperature=0.8, top_k=2**63 - 1), _row(temperature=0.8, top_k=65)]
    for row in rows:
        row.params.logprobs = 2
    sampled = Sampler(seed=0)(logits, rows)
    assert all(0 <= s.token_id < 64 and s.logprob is not None and math.isfinite(s.logprob) for s in sampled)
    probs = Sampler().target_probs(logits, rows)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(dim=-1), torch.ones(3))


@pytest.mark.parametrize(("penalty", "temperature", "scale"),
                         [(1e-30, 1e-5, 1e4), (1e-300, 0.8, 5.0), (1e300, 0.8, 5.0)])
def test_sampler_keeps_penalised_logits_finite(penalty: float, temperature: float, scale: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 64) * scale
    logits[1] = -logits[1].abs() - 1  # every logit negative: a huge penalty sends them all to -inf
    seen = list(range(64))
    rows = [SamplingRow(SamplingParams(temperature=temperature, repetition_penalty=penalty, logprobs=1), seen, [1],
                        banned_token_ids=[7]) for _ in range(2)]
    sampler = Sampler(seed=0)
    adjusted = sampler.adjusted_logits(logits, rows)
    assert not adjusted.isnan().any() and not adjusted.isposinf().any()
    assert adjusted[:, 7].isneginf().all()  # a ban is still a ban
    probs = sampler.target_probs(adjusted, rows)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(dim=-1), torch.ones(2))
    assert (probs[:, 7] == 0).all()
    for token in sampler(logits, rows):
        assert token.token_id != 7 and token.logprob is not None and math.isfinite(token.logprob)


def test_sampler_caps_a_temperature_past_float32() -> None:
    logits = torch.randn(1, 64)
    row = SamplingRow(SamplingParams(temperature=1e300), [], [], banned_token_ids=[0])
    probs = Sampler().target_probs(Sampler().adjusted_logits(logits, [row]), [row])
    assert torch.isfinite(probs).all() and probs[0, 0] == 0


def test_sampler_ignores_banned_ids_outside_the_vocabulary() -> None:
    row = SamplingRow(SamplingParams(temperature=0.8), [], [], banned_token_ids=[-(2**70), -1, 2**70, 5])
    adjusted = Sampler().adjusted_logits(torch.zeros(1, 64), [row])
    assert adjusted[0, 5].isneginf() and adjusted[0, 63] == 0 and int(adjusted.isneginf().sum()) == 1


# --- the request models --------------------------------------------------------------------------
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", '"NaN"', '"nan"', '"inf"', '"-Infinity"', "1e400"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty", "presence_penalty", "min_p"])
def test_request_models_refuse_non_finite_numbers(field: str, literal: str) -> None:
    raw = f'{{"model": "{MODEL}", "messages": {HELLO}, "{field}": {literal}}}'
    with pytest.raises(ValidationError) as error:
        ChatCompletionRequest.model_validate(json.loads(raw))
    assert error.value.errors()[0]["loc"] == (field,)


@pytest.mark.parametrize(("field", "value"), [
    ("seed", 2**63), ("seed", -(2**63) - 1), ("top_k", -2), ("min_tokens", 2**31), ("min_tokens", -1),
    ("max_tokens", 2**70), ("max_tokens", 0), ("stop_token_ids", [-1]), ("stop_token_ids", list(range(1025))),
    ("temperature", -0.5), ("top_p", 0), ("top_p", 1.5), ("min_p", 1.01), ("repetition_penalty", 0),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.5),
])
def test_request_models_bound_every_number(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as error:
        CompletionRequest.model_validate({"model": MODEL, "prompt": "Hi", field: value})
    assert error.value.errors()[0]["loc"][0] == field
    if field == "max_tokens":
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({"messages": json.loads(HELLO), "max_completion_tokens": value})


def test_request_models_keep_the_valid_edges() -> None:
    body = CompletionRequest.model_validate({
        "prompt": "Hi", "seed": SEED_MAX, "top_k": -1, "min_tokens": 0, "max_tokens": 2**31 - 1,
        "stop_token_ids": list(range(1024)), "temperature": 0, "top_p": 1, "min_p": 1, "presence_penalty": -2,
        "frequency_penalty": 2, "repetition_penalty": 1e-9,
    })
    params = body.sampling_params(16, None, vocab_size=VOCAB)
    assert (params.seed, params.top_k, params.max_tokens) == (SEED_MAX, 0, 16)
    with pytest.raises(ValueError, match="^top_k must be at most"):
        CompletionRequest.model_validate({"prompt": "Hi", "top_k": VOCAB + 1}).sampling_params(16, None, VOCAB)


# --- the surrogate middleware, in process ----------------------------------------------------------
def test_holds_lone_surrogate() -> None:
    assert holds_lone_surrogate(b'{"a": "x\\ud800y"}')
    assert holds_lone_surrogate(b'{"a": ["ok", {"b": "\\uDFFF"}]}')
    assert holds_lone_surrogate(b'{"\\udc00": 1}')  # keys too
    assert holds_lone_surrogate(b'{"a": "\\ude00\\ud83d"}')  # a pair the wrong way round
    assert holds_lone_surrogate(b'{"a": "\xed\xa0\x80"}')  # a surrogate as raw (CESU-8) bytes
    assert not holds_lone_surrogate(b'{"a": "\\ud83d\\ude00"}')  # a valid pair: one emoji
    assert not holds_lone_surrogate(b'{"a": "\\\\ud800"}')  # an escaped backslash: plain text
    assert not holds_lone_surrogate('{"a": "caf\u00e9 \U0001f600"}'.encode())
    assert not holds_lone_surrogate(b'not json \\ud800')  # left to the app
    assert not holds_lone_surrogate(b"")


@pytest.fixture(scope="module")
def echo_client() -> Iterator[TestClient]:
    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        return JSONResponse({"text": json.loads(body).get("text")} if body.startswith(b"{") else {"raw": len(body)})

    app = RequestLimitMiddleware(Starlette(routes=[Route("/echo", echo, methods=["POST"])]), RequestLimits())
    with TestClient(app) as client:
        yield client


def test_middleware_refuses_a_lone_surrogate_and_passes_a_pair(echo_client: TestClient) -> None:
    headers = {"content-type": "application/json"}
    refused = echo_client.post("/echo", content=b'{"text": "hi \\ud800"}', headers=headers)
    _check_unicode_error(refused)
    assert refused.headers.get("connection") != "close"  # the body was read whole: keep-alive
    passed = echo_client.post("/echo", content=b'{"text": "hi \\ud83d\\ude00"}', headers=headers)
    assert passed.status_code == 200 and passed.json() == {"text": "hi \U0001f600"}
    assert echo_client.post("/echo", content=b"plain \\ud800 text").json() == {"raw": 17}


# --- live replays against `tandem serve` -----------------------------------------------------------
def _raw(path: str, url: str, body: str | bytes) -> httpx.Response:
    content = body.encode() if isinstance(body, str) else body
    return httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)


def _check_error(response: httpx.Response, param: str | None) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and isinstance(error["message"], str)
    if param is not None:
        assert error["param"] == param, error
        assert param in error["message"], error
    return error


def _check_unicode_error(response: httpx.Response) -> None:
    error = _check_error(response, None)
    assert error["code"] == "invalid_unicode" and "not valid Unicode" in error["message"], error


def _chat(**fields: str) -> str:
    extra = "".join(f', "{k}": {v}' for k, v in fields.items())
    return f'{{"model": "{MODEL}", "messages": {HELLO}, "max_tokens": 4{extra}}}'


def _completion(**fields: str) -> str:
    extra = "".join(f', "{k}": {v}' for k, v in fields.items())
    return f'{{"model": "{MODEL}", "prompt": "Hello", "max_tokens": 4{extra}}}'


ATTACKS: list[tuple[str, str, str, str]] = [
    ("top_k 2**63", "/v1/chat/completions", _chat(top_k=str(2**63), temperature="0.8"), "top_k"),
    ("top_k 2**63 completion", "/v1/completions", _completion(top_k=str(2**63), temperature="0.8"), "top_k"),
    ("seed 2**70", "/v1/chat/completions", _chat(seed=str(2**70), temperature="0.8"), "seed"),
    ("seed -2**70", "/v1/chat/completions", _chat(seed=str(-(2**70)), temperature="0.8"), "seed"),
    ("seed 2**70 n=2 completion", "/v1/completions", _completion(seed=str(2**70), n="2", temperature="0.8"), "seed"),
    ("temperature NaN literal", "/v1/chat/completions", _chat(temperature="NaN"), "temperature"),
    ("temperature Infinity literal", "/v1/chat/completions", _chat(temperature="Infinity"), "temperature"),
    ("repetition_penalty Infinity literal", "/v1/completions", _completion(repetition_penalty="Infinity"),
     "repetition_penalty"),
    ("temperature NaN string", "/v1/chat/completions", _chat(temperature='"NaN"'), "temperature"),
    ("temperature Infinity string", "/v1/chat/completions", _chat(temperature='"Infinity"'), "temperature"),
    ("temperature inf string", "/v1/completions", _completion(temperature='"inf"'), "temperature"),
    ("repetition_penalty NaN", "/v1/chat/completions", _chat(repetition_penalty="NaN", temperature="0.8"),
     "repetition_penalty"),
    ("repetition_penalty NaN string", "/v1/completions", _completion(repetition_penalty='"nan"'), "repetition_penalty"),
    ("stop_token_ids -2**70 with min_tokens", "/v1/completions",
     _completion(stop_token_ids=f"[{-(2**70)}]", min_tokens="2"), "stop_token_ids.0"),
    ("max_tokens 2**70", "/v1/chat/completions", _chat(max_completion_tokens=str(2**70)), "max_completion_tokens"),
]

SURROGATES: list[tuple[str, str, bytes]] = [
    ("chat message", "/v1/chat/completions",
     b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi \\ud800"}], "max_tokens": 4}'),
    ("completion prompt", "/v1/completions", b'{"model": "smollm2-135m", "prompt": "\\udfffHi", "max_tokens": 4}'),
    ("tokenize prompt", "/tokenize", b'{"prompt": "Hi \\udbff"}'),
    ("tokenize messages", "/tokenize", b'{"messages": [{"role": "user", "content": "\\ude00\\ud83d"}]}'),
]


@pytest.fixture(scope="module")
def greedy_before(tandem_server_process: LiveServer) -> str:
    """An ordinary greedy answer before any attack, to compare with the one after them all."""
    reply = httpx.post(f"{tandem_server_process.url}/v1/chat/completions", json=GREEDY, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize(("case", "path", "body", "param"), ATTACKS, ids=[a[0] for a in ATTACKS])
def test_attack_is_a_400(tandem_server_process: LiveServer, greedy_before: str,
                         case: str, path: str, body: str, param: str) -> None:
    _check_error(_raw(path, tandem_server_process.url, body), param)
    assert httpx.get(f"{tandem_server_process.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize(("case", "path", "body"), SURROGATES, ids=[s[0] for s in SURROGATES])
def test_lone_surrogate_is_a_400(tandem_server_process: LiveServer, greedy_before: str,
                                 case: str, path: str, body: bytes) -> None:
    _check_unicode_error(_raw(path, tandem_server_process.url, body))


def test_valid_edges_still_run(tandem_server_process: LiveServer, greedy_before: str) -> None:
    """The largest seed with n > 1 (each child's seed is seed + index, wrapped into int64) and
    top_k at the vocabulary's size are valid, and run."""
    url = tandem_server_process.url
    reply = _raw("/v1/completions", url, _completion(seed=str(SEED_MAX), n="3", temperature="0.8"))
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 3, reply.text
    reply = _raw("/v1/completions", url, _completion(top_k=str(VOCAB), temperature="0.8", repetition_penalty="1e-30"))
    assert reply.status_code == 200, reply.text
    reply = _raw("/v1/chat/completions", url, b'{"model": "smollm2-135m", "max_tokens": 2, '
                 b'"messages": [{"role": "user", "content": "Smile \\ud83d\\ude00"}]}')
    assert reply.status_code == 200, reply.text


def test_worker_survives_the_attacks(tandem_server_process: LiveServer, greedy_before: str) -> None:
    url = tandem_server_process.url
    for _, path, body, _ in ATTACKS:
        _raw(path, url, body)
    for _, path, body in SURROGATES:
        _raw(path, url, body)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    reply = httpx.post(f"{url}/v1/chat/completions", json=GREEDY, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == greedy_before
    load = tandem_server_process.wait_idle()
    assert load["kv_blocks_used"] == 0 and load["num_requests_in_flight"] == 0, load


def test_router_refuses_a_lone_surrogate(tandem_server_process: LiveServer, tmp_path: Path) -> None:
    """The router runs the same middleware: a 400 there, not a 500, and it still routes."""
    url, router = start_router(tmp_path / "route.log", "--worker", tandem_server_process.url, "--no-ledger")
    try:
        for _, path, body in SURROGATES:
            if path.startswith("/v1/"):
                _check_unicode_error(_raw(path, url, body))
        reply = httpx.post(f"{url}/v1/chat/completions", json=GREEDY, timeout=60)
        assert reply.status_code == 200, reply.text
    finally:
        router.terminate()
        try:
            router.wait(30)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait()
    assert tandem_server_process.wait_idle()["kv_blocks_used"] == 0
