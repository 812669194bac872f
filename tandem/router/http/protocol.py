"""A chat response of the router's, answered in the protocol the client spoke.

The proxy serves a Messages or Responses request as the chat request its adapter made of it
(every path: direct, prefill/decode, migration); this turns what came out (a whole reply, an
event stream, an error) back into the client's protocol, keeping status and headers.
"""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse, Response

from tandem.edge.errors import APIError, error_body
from tandem.edge.protocols.base import (
    ProtocolAdapter,
    Translated,
    dropped_headers,
    finish_stream,
    translate_sse,
)
from tandem.router.http.sse import EventStream


def protocol_error(adapter: ProtocolAdapter, exc: APIError) -> JSONResponse:
    return JSONResponse(adapter.error_body(exc.status, exc.body()), status_code=exc.status, headers=exc.headers)


def _headers(response: Response, translated: Translated) -> dict[str, str]:
    kept = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    if translated.dropped:
        kept.update(dropped_headers(translated))
    return kept


async def in_protocol(response: Response, adapter: ProtocolAdapter, translated: Translated) -> Response:
    if isinstance(response, EventStream):
        translator = adapter.stream(translated)
        response.body_iterator = translate_sse(response.body_iterator, translator,
                                               lambda: finish_stream(adapter, translated, translator))
        if translated.dropped:
            response.headers.update(dropped_headers(translated))
        return response
    try:
        body = json.loads(bytes(response.body)) if response.body else None
    except ValueError:
        body = None
    if response.status_code >= 400:
        if not isinstance(body, dict) or "error" not in body:
            body = error_body(response.status_code, bytes(response.body).decode(errors="replace")[:500])
        return JSONResponse(adapter.error_body(response.status_code, body), status_code=response.status_code,
                            headers=_headers(response, translated))
    if not isinstance(body, dict):
        return response
    return JSONResponse(await adapter.reply(body, translated), status_code=response.status_code,
                        headers=_headers(response, translated))
