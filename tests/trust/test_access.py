"""Who may call what (tandem/trust/access.py), for the worker's and the router's policies,
over a stand-in app that answers 200 wherever the middleware lets a request through."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse

from tandem.config import ServerConfig
from tandem.router.config import AccountingConfig, RouterConfig
from tandem.router.http.app import router_access_policy
from tandem.server.app import worker_access_policy
from tandem.trust.access import AccessMiddleware, AccessPolicy, is_peer
from tandem.trust.peer import PeerAuth

SECRET = "cluster-secret"


async def _echo(scope, receive, send) -> None:  # noqa: ANN001
    request = Request(scope, receive)
    body = await request.body()
    await JSONResponse({"peer": is_peer(request), "body": body.decode()})(scope, receive, send)


def _status(policy: AccessPolicy, method: str, path: str, token: str | None = None, signed: bool = False,
            body: bytes = b"") -> tuple[int, dict]:
    app = AccessMiddleware(_echo, policy)
    headers = {"authorization": f"Bearer {token}"} if token else {}

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w",
                                     auth=PeerAuth(SECRET) if signed else None) as client:
            return await client.request(method, path, headers=headers, content=body)

    response = asyncio.run(call())
    return response.status_code, response.json()


WORKER_PATHS = [("GET", "/health"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("GET", "/load"),
                ("GET", "/metrics"), ("GET", "/kv/events"), ("POST", "/kv/release"), ("POST", "/reset_prefix_cache")]


def test_a_worker_with_nothing_configured_is_open() -> None:
    policy = worker_access_policy(ServerConfig(), None)
    assert all(_status(policy, m, p)[0] == 200 for m, p in WORKER_PATHS)


def test_a_worker_with_a_cluster_secret_answers_only_its_peers() -> None:
    policy = worker_access_policy(ServerConfig(), SECRET)
    for method, path in WORKER_PATHS:
        status, body = _status(policy, method, path)
        assert status == (200 if path == "/health" else 401), path
        status, body = _status(policy, method, path, signed=True, body=b'{"x": 1}' if method == "POST" else b"")
        assert status == 200 and body["peer"] is True, path
        if method == "POST":
            assert body["body"] == '{"x": 1}'  # the signed body reaches the app unchanged
    # The operator's bearer token (here the secret, no admin key given) opens the control plane,
    # but it is no peer: it cannot carry internal fields.
    status, body = _status(policy, "POST", "/reset_prefix_cache", token=SECRET)
    assert status == 200 and body["peer"] is False
    assert _status(policy, "POST", "/v1/chat/completions", token=SECRET)[0] == 401


def test_a_forged_signature_is_refused_not_just_ignored() -> None:
    policy = worker_access_policy(ServerConfig(api_key="sk-client"), SECRET)
    app = AccessMiddleware(_echo, policy)

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w",
                                     auth=PeerAuth("a guess")) as client:
            return await client.post("/v1/chat/completions", headers={"authorization": "Bearer sk-client"},
                                     content=b"{}")

    response = asyncio.run(call())
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_peer_signature"


def test_a_worker_api_key_opens_its_client_endpoints_only() -> None:
    policy = worker_access_policy(ServerConfig(api_key="sk-client", admin_key="sk-admin"), SECRET)
    assert _status(policy, "POST", "/v1/chat/completions", token="sk-client") == (200, {"peer": False, "body": ""})
    assert _status(policy, "POST", "/reset_prefix_cache", token="sk-client")[0] == 401
    assert _status(policy, "POST", "/reset_prefix_cache", token="sk-admin")[0] == 200
    assert _status(policy, "GET", "/metrics", token="sk-admin")[0] == 200
    assert _status(policy, "GET", "/metrics")[0] == 401
    public = worker_access_policy(ServerConfig(api_key="sk-client", public_metrics=True), None)
    assert _status(public, "GET", "/metrics")[0] == 200 and _status(public, "GET", "/load")[0] == 200
    assert _status(public, "GET", "/kv/events")[0] == 401  # block hashes are not metrics


def test_an_x_api_key_is_a_client_key_too() -> None:
    """Anthropic's clients (Claude Code) send the key as `x-api-key`."""
    policy = worker_access_policy(ServerConfig(api_key="sk-client"), None)
    app = AccessMiddleware(_echo, policy)

    def status(headers: dict[str, str]) -> int:
        async def call() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as client:
                return await client.post("/v1/messages", headers=headers, content=b"{}")

        return asyncio.run(call()).status_code

    assert status({"x-api-key": "sk-client"}) == 200
    assert status({"x-api-key": "sk-wrong"}) == 401 and status({"x-api-key": " "}) == 401 and status({}) == 401
    assert status({"authorization": "Bearer sk-client", "x-api-key": "sk-wrong"}) == 200  # the bearer first


def test_an_api_key_alone_still_guards_the_control_plane() -> None:
    """A worker started with --api-key only (no secret, no admin key), as before: the key opens
    everything it opened; nothing is open without it."""
    policy = worker_access_policy(ServerConfig(api_key="sk"), None)
    for method, path in WORKER_PATHS[1:]:
        assert _status(policy, method, path)[0] == 401, path
        assert _status(policy, method, path, token="sk")[0] == 200, path


@pytest.mark.parametrize("keys, admin, secret, public, expected", [
    # (api keys, admin key, cluster secret, --public-metrics): (views, control without / with token)
    (False, None, None, False, (200, 200, 200)),  # a dev router: open
    (False, None, SECRET, False, (200, 401, 200)),  # tandem up: views open, control needs the secret
    (True, None, SECRET, False, (401, 401, 200)),  # keys on: views close too
    (True, None, SECRET, True, (200, 401, 200)),  # unless --public-metrics
    (True, None, None, False, (403, 403, 403)),  # keys on and no admin token at all: refused, saying why
    (False, "sk-admin", SECRET, False, (401, 401, 200)),
])
def test_the_router_policy(keys: bool, admin: str | None, secret: str | None, public: bool,
                           expected: tuple[int, int, int], tmp_path) -> None:  # noqa: ANN001
    accounting = AccountingConfig(api_keys_file=tmp_path / "keys.json" if keys else None)
    config = RouterConfig(accounting=accounting, admin_key=admin, cluster_secret=secret, public_metrics=public)
    policy = router_access_policy(config)
    token = admin or secret
    views = _status(policy, "GET", "/metrics")[0]
    control = _status(policy, "POST", "/workers/reload")[0]
    with_token = _status(policy, "POST", "/workers/reload", token=token)[0]
    assert (views, control, with_token) == expected
    assert _status(policy, "GET", "/health")[0] == 200
    assert _status(policy, "GET", "/dashboard")[0] == 200  # a page without data
    assert _status(policy, "GET", "/workers", token=token)[0] == (200 if expected[2] == 200 else expected[0])
