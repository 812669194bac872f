"""The router's OpenAPI schema: its /v1 request bodies are the workers' own models.

The router forwards a request's body as it came (a worker validates it and answers any error
in OpenAI's shape), so its routes take a raw `Request` and FastAPI would document them with
no body at all. Clients, SDK generators and the fuzzer (tests/router/test_fuzz.py) need the
contract, which is the worker's: the same pydantic models (tandem/edge/openai_protocol.py, which
needs no torch) describe both.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tandem.edge.openai_protocol import ChatCompletionRequest, CompletionRequest

BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


def document_request_bodies(app: FastAPI) -> None:
    """Give `app` an OpenAPI schema whose POST /v1 routes name their request bodies."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in BODIES.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}
                        }
                    },
                }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
