"""Errors the router itself raises, in OpenAI's shape.

The router keeps its own copy of the error body instead of importing tandem.server: the
server package pulls in the engine client, and the router must stay torch-free.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    error_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class RouterError(Exception):
    """A request the router answers itself (no worker could, or the input is unusable)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, None, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def no_worker(pool: str) -> RouterError:
    return RouterError(
        503,
        f"no healthy {pool} worker is available; retry shortly",
        "no_healthy_worker",
        {"Retry-After": "1"},
    )
