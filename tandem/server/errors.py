"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every refusal the server makes goes through `APIError`, so clients (the openai SDK maps the
status to an exception class and reads `error.message`) always get the same structure.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
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


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    error_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


async def api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """Pydantic's list of problems, condensed to the first one a person should fix."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body").response()
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        return APIError(400, message, None, "invalid_json").response()
    if first.get("type") == "missing":
        message = f"missing required field '{param}'"
    else:
        message = f"invalid value for '{param}': {first.get('msg')}" if param else str(first.get("msg"))
    extra = len(errors) - 1
    if extra:
        message += f" (and {extra} more problem{'s' if extra > 1 else ''})"
    return APIError(400, message, param, "invalid_value").response()


async def http_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    try:
        phrase = HTTPStatus(exc.status_code).phrase
    except ValueError:
        phrase = "error"
    message = exc.detail if isinstance(exc.detail, str) else phrase
    return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))
