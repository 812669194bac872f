"""Peer signatures over HTTP (tandem/trust/peer.py) and their replay guard (replay.py)."""

from __future__ import annotations

import time

import httpx
import pytest

from tandem.trust.keys import HTTP, derive_key
from tandem.trust.peer import HEADER, PeerAuth, PeerVerifier, sign
from tandem.trust.replay import ReplayGuard

SECRET = "cluster-secret"
KEY = derive_key(SECRET, HTTP)
BODY = b'{"kv_transfer_params": {"do_remote_decode": true}}'


def test_a_signed_request_verifies_once() -> None:
    verifier = PeerVerifier(SECRET)
    header = sign(KEY, "POST", b"/v1/chat/completions", BODY)
    assert verifier.refusal(header, "POST", b"/v1/chat/completions", BODY) is None
    assert verifier.refusal(header, "POST", b"/v1/chat/completions", BODY) == "replayed message"


@pytest.mark.parametrize("method, target, body", [
    ("GET", b"/v1/chat/completions", BODY),  # another method
    ("POST", b"/v1/completions", BODY),  # another endpoint
    ("POST", b"/v1/chat/completions?x=1", BODY),  # another query
    ("POST", b"/v1/chat/completions", BODY.replace(b"true", b"false")),  # one changed field
    ("POST", b"/v1/chat/completions", BODY + b" "),  # one more byte
])
def test_the_signature_covers_method_path_query_and_every_body_byte(method: str, target: bytes, body: bytes) -> None:
    header = sign(KEY, "POST", b"/v1/chat/completions", BODY)
    assert "wrong signature" in (PeerVerifier(SECRET).refusal(header, method, target, body) or "")


def test_another_secret_or_no_signature_is_refused() -> None:
    header = sign(derive_key("another", HTTP), "POST", b"/x", b"")
    assert "wrong signature" in (PeerVerifier(SECRET).refusal(header, "POST", b"/x", b"") or "")
    assert PeerVerifier(SECRET).refusal(None, "POST", b"/x", b"") == "not signed"
    assert PeerVerifier(SECRET).refusal("v1 1 2", "POST", b"/x", b"") == "malformed signature"


def test_a_stale_stamp_is_refused_even_with_a_valid_mac() -> None:
    old = sign(KEY, "GET", b"/load", b"", now=time.time() - 3600)
    assert "stale" in (PeerVerifier(SECRET).refusal(old, "GET", b"/load", b"") or "")


def test_the_replay_guard_forgets_only_what_cannot_pass_any_more() -> None:
    guard = ReplayGuard(max_skew_s=10, max_entries=3)
    now = 1000.0
    assert guard.check(now, "n" * 16, now=now) is None
    assert guard.check(now, "n" * 16, now=now + 5) == "replayed message"
    assert guard.check(now, "n" * 16, now=now + 100) is not None  # stale by then anyway
    assert guard.check(float("nan"), "m" * 16, now=now) is not None
    assert guard.check(now, "short", now=now) == "message without a nonce"
    assert guard.check(True, "o" * 16, now=now) == "unstamped message"
    for i in range(2):
        assert guard.check(now, f"{i}" * 16, now=now) is None
    assert guard.check(now, "z" * 16, now=now) is not None  # full: refuse rather than forget


def test_peer_auth_signs_what_httpx_sends() -> None:
    seen: list[str | None] = []
    verifier = PeerVerifier(SECRET)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(verifier.refusal(request.headers.get(HEADER), request.method, request.url.raw_path,
                                     request.content))
        return httpx.Response(200)

    with httpx.Client(transport=httpx.MockTransport(handler), auth=PeerAuth(SECRET)) as client:
        client.post("http://worker/v1/chat/completions", json={"a": [1, "é"]})
        client.get("http://worker/kv/events", params={"since": 3})
    assert seen == [None, None]
