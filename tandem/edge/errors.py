"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for server and router.

Every refusal the server (`tandem serve`) or the router (`tandem route`) makes goes through
`APIError` or `error_body`, so clients get one structure and one error type per status
whichever of the two answered: the openai SDK maps the status to an exception class and reads
`error.message`, and code that switches on `error.type` must not see a router 401 typed
differently from a worker's. One module instead of a copy per package keeps the two from
drifting.

It imports FastAPI / Starlette only (no torch, no tandem.engine, no tandem.server), because the
router imports it and must stay deployable on a small CPU box.
"""

from __future__ import annotations

from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# OpenAI's error type per status; other 4xx are invalid_request_error, 5xx server_error.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    """OpenAI's `error.type` for an HTTP status."""
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The JSON body of an error response (or of an SSE error event) with this status."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


class APIError(Exception):
    """A request answered with an error: raise it anywhere under a route, the handler answers.

    `param` names the offending request field (dotted for nested ones), `code` is a stable
    machine-readable reason (`invalid_api_key`, `no_healthy_worker`, ...), and `headers` go on
    the response (`Retry-After`, `WWW-Authenticate`).
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


async def api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """`app.add_exception_handler(APIError, api_error_handler)`."""
    assert isinstance(exc, APIError)
    return exc.response()


async def validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """Pydantic's list of problems, condensed to the first one a person should fix."""
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc.errors()).response()


def validation_error(errors: Sequence[Any]) -> APIError:
    """The 400 for pydantic's list of problems (`exc.errors()`), naming the first one."""
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        return APIError(400, message, None, "invalid_json")
    if first.get("type") == "missing":
        message = f"missing required field '{param}'"
    else:
        message = f"invalid value for '{param}': {first.get('msg')}" if param else str(first.get("msg"))
    extra = len(errors) - 1
    if extra:
        message += f" (and {extra} more problem{'s' if extra > 1 else ''})"
    return APIError(400, message, param, "invalid_value")


async def http_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (unknown route 404, wrong method 405) in OpenAI's shape."""
    assert isinstance(exc, StarletteHTTPException)
    try:
        phrase = HTTPStatus(exc.status_code).phrase
    except ValueError:
        phrase = "error"
    message = exc.detail if isinstance(exc.detail, str) else phrase
    return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))
