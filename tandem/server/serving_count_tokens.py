"""`POST /v1/messages/count_tokens` on a worker: the prompt a Messages request would run.

The body is translated as `/v1/messages` translates it (the billing header dropped, tools
rendered, a final assistant message continued), then rendered and tokenized exactly as the
chat path renders it, so the count equals the three input fields of that request's usage
(`input_tokens` + `cache_creation_input_tokens` + `cache_read_input_tokens`).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.edge.errors import APIError
from tandem.edge.limits import check_shape
from tandem.edge.protocols.anthropic_messages import MessagesAdapter
from tandem.server.chat_prompt import render_chat_prompt
from tandem.server.serving import ServingState
from tandem.server.serving_protocol import chat_request, protocol_error, read_json


async def count_tokens(state: ServingState, adapter: MessagesAdapter, raw: Request) -> Response:
    try:
        translated = await adapter.count_chat(await read_json(raw), raw.headers)
        body = chat_request(translated)
        state.check_model(body.model)
        check_shape({"messages": body.messages, "tools": body.tools or []}, state.config.limits)
        prompt = render_chat_prompt(state.tokenizer, body.messages, body.tools, body.tool_choice,
                                    state.tool_parser, body.add_generation_prompt, body.continue_final_message,
                                    body.chat_template_kwargs)
        count = len(state.encode(prompt.text, add_special_tokens=False))
    except APIError as exc:
        state.metrics.observe_error(exc.status)
        return protocol_error(adapter, exc)
    return JSONResponse({"input_tokens": count})
