"""`POST /v1/messages/count_tokens` on the router: a worker's `/tokenize` counts the prompt.

The router renders no chat templates (placement/tokenize.py says why), so the body is
translated as `/v1/messages` would be and the chat fields go to a healthy worker's
`/tokenize`, which renders them exactly as the chat path does. The first worker that answers
below 500 decides: its count, or its refusal (an unknown model, a template error) in
Anthropic's shape; none answering is a 503.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.edge.errors import APIError, error_body
from tandem.edge.protocols.anthropic_messages import MessagesAdapter
from tandem.router.http.protocol import protocol_error
from tandem.router.placement.tokenize import tokenize_body
from tandem.router.workers.registry import WorkerEndpoint
from tandem.trust.fields import strip_internal

logger = logging.getLogger(__name__)


async def count_tokens(adapter: MessagesAdapter, request: Request, workers: list[WorkerEndpoint],
                       client: httpx.AsyncClient, headers: dict[str, str], timeout_s: float) -> Response:
    try:
        translated = await adapter.count_chat(await _json_body(request), request.headers)
        body = tokenize_body(strip_internal(translated.chat), "chat")
        if body is None:
            raise APIError(400, "'messages' must be a list", "messages", "invalid_value")
    except APIError as exc:
        return protocol_error(adapter, exc)
    for worker in workers:
        try:
            reply = await client.post(f"{worker.url}/tokenize", json=body, headers=headers,
                                      timeout=httpx.Timeout(timeout_s))
        except httpx.HTTPError as exc:
            logger.debug("POST %s/tokenize failed: %s", worker.url, exc)
            continue
        if reply.status_code >= 500:
            continue
        payload = _json(reply.content)
        if reply.status_code != 200:
            if not isinstance(payload, dict) or "error" not in payload:
                payload = error_body(reply.status_code, reply.text[:500])
            return JSONResponse(adapter.error_body(reply.status_code, payload), status_code=reply.status_code)
        count = payload.get("count") if isinstance(payload, dict) else None
        if isinstance(count, int):
            return JSONResponse({"input_tokens": count})
    exc = APIError(503, "no healthy worker answered POST /tokenize", code="no_healthy_worker")
    return protocol_error(adapter, exc)


def _json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return None


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_value")
    return body
