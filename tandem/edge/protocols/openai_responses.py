"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) over the chat path.

What Codex CLI (`wire_api = "responses"`) and the openai SDK's `client.responses` send is read
into a chat request (responses_request), answered whole (responses_models) or as the
Responses event stream (responses_stream), and, unless the request says `store: false`, kept
in a response store (response_store) under its `resp_…` id: `previous_response_id` then
continues the conversation (the stored one is prepended to the new input) and
`GET /v1/responses/{id}` reads it back.

The session a request belongs to, for the router's affinity: the `session-id` header (Codex
sends one), else `prompt_cache_key` (Codex's session id again), else the session of the
response it continues, else `user`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar

from tandem.edge.errors import APIError
from tandem.edge.protocols import responses_request as req
from tandem.edge.protocols.base import ProtocolAdapter, StreamTranslator, Translated
from tandem.edge.protocols.response_store import (
    MAX_ID_LENGTH,
    ResponseStore,
    ResponseStoreError,
    StoredResponse,
)
from tandem.edge.protocols.responses_models import ResponsesTranslated, echo_fields, whole_response
from tandem.edge.protocols.responses_stream import ResponsesStream

logger = logging.getLogger(__name__)

SESSION_HEADERS = ("session-id", "session_id")
MAX_SESSION_LENGTH = 512


class OpenAIResponsesAdapter(ProtocolAdapter):
    name: ClassVar[str] = "responses"

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    # --- request -------------------------------------------------------------------------
    async def to_chat(self, body: dict[str, Any], headers: Mapping[str, str], caller: str = "") -> Translated:
        dropped: list[str] = []
        store = req.optional_bool(body, "store", True)
        stream = req.optional_bool(body, "stream", False)
        parallel = req.optional_bool(body, "parallel_tool_calls", True)
        model = req.optional_string(body, "model")
        instructions = req.optional_string(body, "instructions")
        user = req.optional_string(body, "user")
        previous_id = req.optional_string(body, "previous_response_id")
        previous = await self._previous(previous_id, caller) if previous_id is not None else None
        items = req.normalize_input(body.get("input"), dropped)
        conversation = [*(previous.conversation if previous else []), *items]
        if not conversation:
            raise req.bad("'input' is required: a string or a list of input items", "input", "missing")
        tools = req.translate_tools(body.get("tools"), dropped)
        tool_choice = req.translate_tool_choice(body.get("tool_choice"), tools, dropped)
        response_format = req.text_format(body.get("text"))
        max_tokens = req.max_output_tokens(body.get("max_output_tokens"))
        for unsupported in ("background", "conversation"):
            if body.get(unsupported):
                dropped.append(unsupported)

        chat: dict[str, Any] = {"messages": req.to_messages(instructions, conversation), "stream": stream,
                                **req.passed_through(body)}
        if model is not None:
            chat["model"] = model
        if tools.chat:
            chat["tools"] = tools.chat
            if tool_choice is not None:
                chat["tool_choice"] = tool_choice
            chat["parallel_tool_calls"] = parallel
        if max_tokens is not None:
            chat["max_tokens"] = max_tokens
        if response_format is not None:
            chat["response_format"] = response_format
        for key in ("temperature", "top_p"):
            if body.get(key) is not None:
                chat[key] = body[key]
        if user is not None:
            chat["user"] = user
        if stream:
            chat["stream_options"] = {"include_usage": True}  # the completed event's exact usage
        return ResponsesTranslated(
            chat=chat,
            session=_session(headers, body, previous, user),
            dropped=dropped,
            response_id=f"resp_{uuid.uuid4().hex}",
            created_at=int(time.time()),
            model=model,
            echo=echo_fields(body, store, parallel),
            tools=tools,
            conversation=conversation,
            store=store,
            owner=caller,
        )

    async def _previous(self, response_id: str, caller: str) -> StoredResponse:
        found = await self._get(response_id, caller)
        if found is None:
            raise APIError(404, f"Previous response with id '{response_id[:MAX_ID_LENGTH]}' not found: it was "
                           "never stored (store: false), has expired, or was stored by another server "
                           "(share a Redis response store between them)",
                           "previous_response_id", "previous_response_not_found")
        return found

    async def _get(self, response_id: str, caller: str) -> StoredResponse | None:
        """The caller's own stored response: another caller's is as unknown as a missing one
        (a 404 either way, so an id says nothing about whether someone else stored it)."""
        if len(response_id) > MAX_ID_LENGTH:
            return None
        try:
            found = await self.store.get(response_id)
        except ResponseStoreError as exc:
            logger.warning("%s", exc)
            raise APIError(503, "the response store is unavailable; try again", None,
                           "response_store_unavailable") from exc
        return found if found is not None and found.owner == caller else None

    # --- reply ---------------------------------------------------------------------------
    async def reply(self, chat_reply: dict[str, Any], translated: Translated) -> dict[str, Any]:
        assert isinstance(translated, ResponsesTranslated)
        response = whole_response(translated, chat_reply)
        await self.finish(translated, response)
        return response

    def stream(self, translated: Translated) -> StreamTranslator:
        assert isinstance(translated, ResponsesTranslated)
        return ResponsesStream(translated)

    def reply_id(self, translated: Translated, chat_id: str) -> str:
        return translated.response_id if isinstance(translated, ResponsesTranslated) else chat_id

    def error_body(self, status: int, openai_body: dict[str, Any]) -> dict[str, Any]:
        return openai_body  # the Responses API answers errors in OpenAI's shape

    async def finish(self, translated: Translated, response: dict[str, Any]) -> None:
        """Keep the response (unless `store: false`); a store that fails costs a warning, not
        the answer: the client has its response, only a continuation of it will miss."""
        assert isinstance(translated, ResponsesTranslated)
        if not translated.store or response.get("status") not in ("completed", "incomplete"):
            return
        entry = StoredResponse(response, [*translated.conversation, *response["output"]], translated.session,
                               owner=translated.owner)
        try:
            await self.store.put(entry)
        except ResponseStoreError as exc:
            logger.warning("%s", exc)

    # --- GET /v1/responses/{id} ----------------------------------------------------------
    async def retrieve(self, response_id: str, caller: str = "") -> dict[str, Any]:
        """The caller's stored response; 404 if it was never stored, has expired or been
        evicted, or is another caller's."""
        found = await self._get(response_id, caller)
        if found is None:
            raise APIError(404, f"No response with id '{response_id[:MAX_ID_LENGTH]}' is stored here",
                           "response_id", "response_not_found")
        return found.response

    async def delete(self, response_id: str, caller: str = "") -> dict[str, Any]:
        """DELETE /v1/responses/{id}: forget the caller's stored response (a later GET or
        previous_response_id is a 404); 404 for one it cannot see, as GET is."""
        found = await self._get(response_id, caller)
        if found is None:
            raise APIError(404, f"No response with id '{response_id[:MAX_ID_LENGTH]}' is stored here",
                           "response_id", "response_not_found")
        try:
            await self.store.delete(found.id)
        except ResponseStoreError as exc:
            logger.warning("%s", exc)
            raise APIError(503, "the response store is unavailable; try again", None,
                           "response_store_unavailable") from exc
        return {"id": found.id, "object": "response", "deleted": True}

    async def close(self) -> None:
        await self.store.close()

    def describe(self) -> str:
        return f"stored responses: {self.store.describe()}"


def _session(headers: Mapping[str, str], body: Mapping[str, Any], previous: StoredResponse | None,
             user: str | None) -> str | None:
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return value[:MAX_SESSION_LENGTH]
    key = body.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return key[:MAX_SESSION_LENGTH]
    if previous is not None and previous.session:
        return previous.session
    return user[:MAX_SESSION_LENGTH] if user else None
