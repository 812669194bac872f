"""The OpenAI error module shared by server and router: types per status, and its handlers.

The handlers run in a real FastAPI app (Starlette's TestClient, in-process), as both the
server and the router install them.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.testclient import TestClient

from tandem.edge.errors import (
    APIError,
    api_error_handler,
    bad_request,
    error_body,
    http_error_handler,
    validation_error_handler,
)


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),  # the router once said invalid_request_error here
        (403, "permission_error"),  # an internal field or the control plane without its key
        (404, "not_found_error"),
        (413, "invalid_request_error"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "server_error"),
        (502, "server_error"),
        (503, "server_error"),
        (504, "server_error"),
    ],
)
def test_error_type_per_status(status: int, error_type: str) -> None:
    assert error_body(status, "m", "p", "c") == {
        "error": {"message": "m", "type": error_type, "param": "p", "code": "c"}
    }


class _Body(BaseModel):
    n: int
    name: str


def _app() -> FastAPI:
    app = FastAPI()
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)

    @app.get("/refuse")
    async def refuse() -> None:
        raise APIError(401, "no key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/bad")
    async def bad() -> None:
        raise bad_request("temperature must be >= 0", "temperature")

    @app.post("/body")
    async def body(payload: _Body) -> dict[str, int]:
        return {"n": payload.n}

    return app


def test_api_error_answers_with_its_status_body_and_headers() -> None:
    client = TestClient(_app())
    reply = client.get("/refuse")
    assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
    assert reply.json() == {
        "error": {
            "message": "no key",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    reply = client.get("/bad")
    assert reply.status_code == 400
    assert reply.json()["error"] == {
        "message": "temperature must be >= 0",
        "type": "invalid_request_error",
        "param": "temperature",
        "code": None,
    }


def test_validation_errors_are_condensed_to_the_first_problem() -> None:
    client = TestClient(_app())
    reply = client.post("/body", json={})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["message"] == "missing required field 'n' (and 1 more problem)"
    assert (error["param"], error["code"], error["type"]) == ("n", "invalid_value", "invalid_request_error")
    reply = client.post("/body", content=b'{"n": ', headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"


def test_starlette_errors_in_openai_shape() -> None:
    client = TestClient(_app())
    reply = client.get("/nothing")
    assert reply.status_code == 404
    assert reply.json()["error"]["type"] == "not_found_error"
    assert reply.json()["error"]["message"] == "Not Found"
    reply = client.get("/body")
    assert reply.status_code == 405 and reply.headers["allow"] == "POST"
    assert reply.json()["error"]["type"] == "invalid_request_error"


def test_the_module_is_torch_free() -> None:
    """The router imports it, and the router must deploy without torch."""
    code = (
        "import sys, tandem.edge.errors; "
        "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
        "or m.startswith(('tandem.engine', 'tandem.server'))])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
