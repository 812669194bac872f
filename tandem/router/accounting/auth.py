"""Router API keys (`--api-keys FILE`): who is calling, and which key the workers get.

With keys on, every request under /v1/ needs `Authorization: Bearer KEY` with a key from the
file, else 401 in OpenAI's shape (code `invalid_api_key`); the key's identity names the caller
in the usage ledger. /health, /metrics, /workers and /workers/reload stay open: they are for
the operator's probes and dashboards, on a network the operator controls, and carry no prompts.

File formats: a JSON or YAML mapping `{"KEY": "IDENTITY", ...}` (by suffix; a file whose
text starts with `{` is read as JSON), or text lines `KEY IDENTITY` (`#` comments and blank
lines skipped). Several keys may share an identity (key rotation).

Keys are looked up by their SHA-256 digest, so the lookup's timing depends on the digest of
what the client sent, never on how much of a real key it guessed right.

What workers receive (`worker_headers`): the router's own `--worker-api-key` when given;
otherwise, with router keys on, no Authorization at all (the client's key is the router's
secret, and must not leak to workers); otherwise the client's header passes through
unchanged, so a keyless router can front workers started with `--api-key`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.errors import error_body
from tandem.router.accounting.datafile import parse_structured, read_text

ANONYMOUS = "anonymous"  # the ledger identity of every caller when keys are off
_STATE_KEY = "tandem_caller"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class ApiKeys:
    by_digest: Mapping[bytes, str] = field(default_factory=dict, repr=False)

    @classmethod
    def from_mapping(cls, keys: Mapping[str, str]) -> ApiKeys:
        return cls({_digest(key): identity for key, identity in keys.items()})

    def identify(self, authorization: str | None) -> str | None:
        """The identity of a `Bearer KEY` header, or None."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        return self.by_digest.get(_digest(token))

    @property
    def identities(self) -> set[str]:
        return set(self.by_digest.values())

    def __len__(self) -> int:
        return len(self.by_digest)


def parse_api_keys(text: str, suffix: str, what: str = "the API key file") -> ApiKeys:
    if suffix.lower() in (".json", ".yaml", ".yml") or text.lstrip().startswith("{"):
        data = parse_structured(text, suffix, what) or {}
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


def worker_headers(
    client: Mapping[str, str], keys_on: bool, worker_api_key: str | None
) -> dict[str, str]:
    """The headers the router sends workers (see the module docstring)."""
    if worker_api_key:
        return {"authorization": f"Bearer {worker_api_key}"}
    if keys_on:
        return {}
    value = client.get("authorization")
    return {"authorization": value} if value is not None else {}


def caller_of(request: Request) -> str:
    """The identity the middleware found for this request (ANONYMOUS when keys are off)."""
    return str(request.scope.get("state", {}).get(_STATE_KEY) or ANONYMOUS)


def requires_key(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


class ApiKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which would get between streams and disconnects)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys | None) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.keys is None or scope["type"] != "http" or not requires_key(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization")
        identity = self.keys.identify(header)
        if identity is None:
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
        scope.setdefault("state", {})[_STATE_KEY] = identity
        await self.app(scope, receive, send)
