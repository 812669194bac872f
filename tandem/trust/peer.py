"""Peer requests over HTTP: the router (or any tandem process) signs, a worker verifies.

A signed request carries one header, `X-Tandem-Peer: v1 TS NONCE MAC`, where MAC is
HMAC-SHA256, under the cluster secret's HTTP key (keys.py), of

    "v1" \\n METHOD \\n PATH?QUERY \\n TS \\n NONCE \\n hex(SHA-256(body))

so the signature covers everything a worker acts on: which endpoint, which query, and every
byte of the body (internal fields included). The secret itself never travels. A stamp more
than a minute off, or a nonce seen before, is refused (replay.py). The Host header is not
covered: a worker is reached under many names (an IP, a Kubernetes service).

`PeerAuth` is an httpx auth that signs every request a client sends: the router hangs it on
its one HTTP client, so hops, health and load polls, KV event reads, tokenize hops and lease
releases are all signed without any call site knowing. `PeerVerifier` is the worker's side.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Generator

import httpx

from tandem.trust.keys import HTTP, derive_key
from tandem.trust.replay import ReplayGuard

HEADER = "x-tandem-peer"
_VERSION = "v1"


def _mac(key: bytes, method: str, target: bytes, stamp: str, nonce: str, body: bytes) -> str:
    message = b"\n".join((_VERSION.encode(), method.upper().encode(), target, stamp.encode(),
                          nonce.encode(), hashlib.sha256(body).hexdigest().encode()))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(key: bytes, method: str, target: bytes, body: bytes, now: float | None = None) -> str:
    """The header value for one request; `target` is the raw path with its query string."""
    stamp = repr(time.time() if now is None else now)
    nonce = secrets.token_hex(16)
    return f"{_VERSION} {stamp} {nonce} {_mac(key, method, target, stamp, nonce, body)}"


class PeerVerifier:
    """A worker's check of `X-Tandem-Peer` headers under its cluster secret."""

    def __init__(self, secret: str, guard: ReplayGuard | None = None) -> None:
        self._key = derive_key(secret, HTTP)
        self._guard = guard or ReplayGuard()

    def refusal(self, header: str | None, method: str, target: bytes, body: bytes) -> str | None:
        """Why the request is not from a peer (None: it is, and its nonce is now spent)."""
        if not header:
            return "not signed"
        parts = header.split(" ")
        if len(parts) != 4 or parts[0] != _VERSION:
            return "malformed signature"
        _, stamp, nonce, mac = parts
        expected = _mac(self._key, method, target, stamp, nonce, body)
        if not hmac.compare_digest(expected.encode(), mac.encode()):
            return "wrong signature (another cluster secret?)"
        try:
            value = float(stamp)
        except ValueError:
            return "malformed time stamp"
        return self._guard.check(value, nonce)


class PeerAuth(httpx.Auth):
    """Signs every request of an httpx client with the cluster secret."""

    requires_request_body = True

    def __init__(self, secret: str) -> None:
        self._key = derive_key(secret, HTTP)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers[HEADER] = sign(self._key, request.method, request.url.raw_path, request.content)
        yield request


def peer_client(secret: str | None, **kwargs: object) -> httpx.Client:
    """A synchronous httpx client whose requests are signed (plain when `secret` is None):
    for tools that talk to a cluster's workers directly (the benches, tests)."""
    return httpx.Client(auth=PeerAuth(secret) if secret else None, **kwargs)  # type: ignore[arg-type]
