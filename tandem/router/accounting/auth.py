"""Router API keys (`--api-keys FILE`): who is calling, and which key the workers get.

With keys on, every request under /v1/ needs `Authorization: Bearer KEY` (or `x-api-key: KEY`,
as Anthropic's clients send it) with a key from the file, else 401 in OpenAI's shape (code
`invalid_api_key`); the key's identity names the caller in the usage ledger. The other
endpoints are not this module's: /health is open, and the control plane and the views
(/workers/*, /metrics, /workers) follow the router's access policy (tandem/trust/access.py,
`router_access_policy` in http/app.py): they need the admin key, the views only once keys
are on and unless --public-metrics.

File formats: a JSON or YAML mapping `{"KEY": "IDENTITY", ...}` (by suffix; a file whose
text starts with `{` is read as JSON), or text lines `KEY IDENTITY` (`#` comments and blank
lines skipped). Several keys may share an identity (key rotation).

Keys are looked up by their SHA-256 digest, so the lookup's timing depends on the digest of
what the client sent, never on how much of a real key it guessed right.

What workers receive (`worker_headers`): the router's own `--worker-api-key` when given;
otherwise, with router keys on, no Authorization at all (the client's key is the router's
secret, and must not leak to workers); otherwise the client's header passes through
unchanged, so a keyless router can front workers started with `--api-key`.

The file `tandem keys` writes (keys_store.py) holds salted hashes and per-key limits, not
keys; the plain formats above are still read (their keys hashed as they load). The router
re-reads the file when it changes (checked at most once a second), so `tandem keys revoke`
takes effect on a running router. Keys appear in no log line.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.edge.errors import error_body
from tandem.router.accounting.datafile import parse_structured, read_text
from tandem.router.accounting.keys_store import (
    KeyLimits,
    StoredKey,
    is_key_store,
    key_id,
    parse_store,
)

logger = logging.getLogger(__name__)

ANONYMOUS = "anonymous"  # the ledger identity of every caller when keys are off
_STATE_KEY = "tandem_caller"
_CALLER_KEY = "tandem_caller_key"
_RECHECK_S = 1.0


@dataclass(frozen=True)
class Caller:
    """Who is calling: the ledger identity, which key (rate limits are per key) and its own
    limits (None where the router's defaults apply)."""

    identity: str
    key: str  # a key-file entry id, or the identity for plain-format keys and no keys
    limits: KeyLimits = field(default_factory=KeyLimits)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class ApiKeys:
    by_digest: Mapping[bytes, str] = field(default_factory=dict, repr=False)
    stored: Mapping[str, StoredKey] = field(default_factory=dict, repr=False)  # by entry id

    @classmethod
    def from_mapping(cls, keys: Mapping[str, str]) -> ApiKeys:
        return cls({_digest(key): identity for key, identity in keys.items()})

    @classmethod
    def from_store(cls, keys: list[StoredKey]) -> ApiKeys:
        return cls(stored={k.id: k for k in keys})

    def authenticate(self, authorization: str | None) -> Caller | None:
        """The caller of a `Bearer KEY` header, or None (no key, a wrong or revoked one)."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        entry = self.stored.get(key_id(token) or "")
        if entry is not None:
            if entry.revoked or not entry.matches(token):
                return None
            return Caller(entry.identity, entry.id, entry.limits)
        identity = self.by_digest.get(_digest(token))
        return None if identity is None else Caller(identity, identity)

    def identify(self, authorization: str | None) -> str | None:
        """The identity of a `Bearer KEY` header, or None."""
        caller = self.authenticate(authorization)
        return None if caller is None else caller.identity

    @property
    def identities(self) -> set[str]:
        live = {k.identity for k in self.stored.values() if not k.revoked}
        return set(self.by_digest.values()) | live

    def __len__(self) -> int:
        return len(self.by_digest) + sum(not k.revoked for k in self.stored.values())


def parse_api_keys(text: str, suffix: str, what: str = "the API key file") -> ApiKeys:
    if suffix.lower() in (".json", ".yaml", ".yml") or text.lstrip().startswith("{"):
        data = parse_structured(text, suffix, what) or {}
        if is_key_store(data):
            keys = ApiKeys.from_store(parse_store(data, what))
            if not len(keys):
                raise ValueError(f"{what} holds no live keys: every request would be refused")
            return keys
        if not isinstance(data, dict):
            raise ValueError(f"{what} must map keys to identities: {{\"sk-...\": \"alice\"}}")
        pairs = [(key, identity, f"key #{n}") for n, (key, identity) in enumerate(data.items(), 1)]
    else:
        pairs = []
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(
                    f"{what}, line {number}: expected `KEY IDENTITY`, got {len(parts)} field(s)"
                )
            pairs.append((parts[0], parts[1], f"line {number}"))
    keys: dict[str, str] = {}
    for key, identity, where in pairs:
        _check(key, identity, f"{what}, {where}")
        if key in keys:
            raise ValueError(f"{what}, {where}: the same key appears twice")
        keys[key] = identity
    if not keys:
        raise ValueError(f"{what} holds no keys: every request would be refused")
    return ApiKeys.from_mapping(keys)


def _check(key: Any, identity: Any, where: str) -> None:
    if not isinstance(key, str) or not key or any(c.isspace() for c in key):
        raise ValueError(f"{where}: a key must be a non-empty string without spaces")
    if not isinstance(identity, str) or not identity.strip():
        raise ValueError(f"{where}: the identity must be a non-empty string, got {identity!r}")


def read_api_keys(path: Path) -> ApiKeys:
    return parse_api_keys(read_text(path, "API key file"), path.suffix, f"API key file {path}")


class KeyFile:
    """The key file as the router uses it: read at start, re-read when it changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._keys = read_api_keys(path)
        self._stamp = self._stat()
        self._checked = time.monotonic()

    def _stat(self) -> tuple[int, int] | None:
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        return info.st_mtime_ns, info.st_size

    def current(self) -> ApiKeys:
        now = time.monotonic()
        if now - self._checked >= _RECHECK_S:
            self._checked = now
            stamp = self._stat()
            if stamp is not None and stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._keys = read_api_keys(self.path)
                    logger.info("API key file %s re-read: %d live key(s)", self.path,
                                len(self._keys))
                except ValueError as exc:  # keep serving with the keys we had
                    logger.error("API key file changed but cannot be read; keeping the "
                                 "previous keys: %s", exc)
        return self._keys

    def authenticate(self, authorization: str | None) -> Caller | None:
        return self.current().authenticate(authorization)

    def identify(self, authorization: str | None) -> str | None:
        return self.current().identify(authorization)

    @property
    def identities(self) -> set[str]:
        return self.current().identities

    def __len__(self) -> int:
        return len(self.current())


def client_authorization(headers: Mapping[str, str]) -> str | None:
    """The client's `Authorization` header, or its `x-api-key` (Anthropic's) as a bearer one."""
    value = headers.get("authorization")
    if value is None and (key := (headers.get("x-api-key") or "").strip()):
        return f"Bearer {key}"
    return value


def worker_headers(
    client: Mapping[str, str], keys_on: bool, worker_api_key: str | None
) -> dict[str, str]:
    """The headers the router sends workers (see the module docstring)."""
    if worker_api_key:
        return {"authorization": f"Bearer {worker_api_key}"}
    if keys_on:
        return {}
    value = client_authorization(client)
    return {"authorization": value} if value is not None else {}


def caller_of(request: Request) -> str:
    """The identity the middleware found for this request (ANONYMOUS when keys are off)."""
    return str(request.scope.get("state", {}).get(_STATE_KEY) or ANONYMOUS)


def caller_key_of(request: Request) -> Caller:
    """The caller with its key and limits (keys off: the anonymous caller)."""
    caller = request.scope.get("state", {}).get(_CALLER_KEY)
    return caller if isinstance(caller, Caller) else Caller(ANONYMOUS, ANONYMOUS)


def requires_key(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


class ApiKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which would get between streams and disconnects)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys | KeyFile | None) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.keys is None or scope["type"] != "http" or not requires_key(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = client_authorization(Headers(scope=scope))
        caller = self.keys.authenticate(header)
        if caller is None:
            message = (
                "Incorrect API key provided"
                if header
                else "You didn't provide an API key; pass it as 'Authorization: Bearer KEY'"
            )
            response = JSONResponse(
                error_body(401, message, None, "invalid_api_key"),
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state[_STATE_KEY] = caller.identity
        state[_CALLER_KEY] = caller
        await self.app(scope, receive, send)
