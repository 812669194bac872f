"""Who may call which endpoint: one ASGI middleware for the worker and the router.

Every path has a level (`Level`), and a request passes when it carries what the level asks:

- PUBLIC: nothing (`/health`; the router's `/v1/*`, which its API-key middleware guards).
- CLIENT: a worker's OpenAI endpoints: a peer's signature, or the worker's `--api-key` (as
  `Authorization: Bearer`, or Anthropic's `x-api-key`); open
  when the worker has neither a cluster secret nor an API key (a standalone dev server).
- OBSERVE: metrics and views (`/metrics`, `/load`, `/workers`, `/openapi.json`):
  open while nothing is configured or with `--public-metrics`; otherwise an operator's
  bearer token or a peer's signature.
- ADMIN: control (`/workers/reload`, drain, resume; `/reset_prefix_cache`, `/kv/*`): an
  operator's bearer token (`--admin-key`, else the cluster secret) or a peer's signature;
  open only while nothing at all is configured.

The middleware also records whether a request was peer-signed (`is_peer`), which is what a
worker checks before it takes an internal field (fields.py). A signature covers the body, so
the body is read here (it was already read and bounded by tandem/edge/limits.py, which sits
outside this middleware) and handed on unchanged.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.edge.errors import error_body
from tandem.edge.limits import replaying
from tandem.trust.keys import same_token
from tandem.trust.peer import HEADER, PeerVerifier

_PEER_STATE = "tandem_peer"


class Level(enum.Enum):
    PUBLIC = "public"
    CLIENT = "client"
    OBSERVE = "observe"
    ADMIN = "admin"


@dataclass(frozen=True)
class AccessPolicy:
    level_of: Callable[[str, str], Level]  # (method, path) -> level
    peers: PeerVerifier | None = None  # set with a cluster secret
    client_key: str | None = None  # a worker's --api-key
    admin_tokens: tuple[str, ...] = ()  # bearer tokens an operator may present
    observe_open: bool = True
    admin_open: bool = True  # nothing configured: a dev setup

    @property
    def clients_open(self) -> bool:
        return self.peers is None and self.client_key is None


def is_peer(request: Request) -> bool:
    """Whether the access middleware found a valid peer signature on this request."""
    return bool(request.scope.get("state", {}).get(_PEER_STATE))


def _bearer(headers: Headers) -> str | None:
    """The caller's token: `Authorization: Bearer <token>`, else `x-api-key` (Anthropic's header)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() == "bearer" and token:
        return token
    return headers.get("x-api-key", "").strip() or None


class AccessMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which would get between streams and disconnects)."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        policy = self.policy
        level = policy.level_of(scope["method"], scope["path"])
        headers = Headers(scope=scope)
        peer = False
        if policy.peers is not None and headers.get(HEADER):
            body, receive = await _buffered(receive)
            target = scope.get("raw_path") or scope["path"].encode()
            if scope.get("query_string"):
                target += b"?" + scope["query_string"]
            refused = policy.peers.refusal(headers.get(HEADER), scope["method"], target, body)
            if refused is not None:
                await _deny(scope, receive, send, 401, f"peer signature refused: {refused}", "invalid_peer_signature")
                return
            peer = True
        scope.setdefault("state", {})[_PEER_STATE] = peer
        denial = None if peer else self._denial(level, _bearer(headers))
        if denial is not None:
            await _deny(scope, receive, send, *denial)
            return
        await self.app(scope, receive, send)

    def _denial(self, level: Level, token: str | None) -> tuple[int, str, str] | None:
        policy = self.policy
        if level is Level.PUBLIC:
            return None
        if level is Level.CLIENT:
            if policy.clients_open:
                return None
            if policy.client_key is not None and token is not None and same_token(token, policy.client_key):
                return None
            if policy.client_key is None:
                return (401, "this worker serves only its cluster's peers: send requests through the router "
                             "(tandem route / tandem up), which signs them with the cluster secret", "peer_required")
            return (401, "Incorrect API key provided; pass it as 'Authorization: Bearer <key>'"
                    if token else "You didn't provide an API key; pass it as 'Authorization: Bearer <key>'",
                    "invalid_api_key")
        if level is Level.OBSERVE and policy.observe_open:
            return None
        if level is Level.ADMIN and policy.admin_open:
            return None
        if not policy.admin_tokens:
            return (403, "this endpoint is for operators, and no admin key is configured: start with "
                         "--admin-key (or a cluster secret) to use it", "admin_key_required")
        if token is not None and any(same_token(token, t) for t in policy.admin_tokens):
            return None
        return (401, "this endpoint needs the admin key: pass it as 'Authorization: Bearer <admin key>' "
                     "(--admin-key, else the cluster secret)", "admin_key_required")


async def _buffered(receive: Receive) -> tuple[bytes, Receive]:
    """The whole request body, and a `receive` that hands it on again."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"", receive  # the client left; the app will see it on its next receive
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    return body, replaying(body, receive)


async def _deny(scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str) -> None:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    response = JSONResponse(error_body(status, message, None, code), status_code=status, headers=headers)
    await response(scope, receive, send)
