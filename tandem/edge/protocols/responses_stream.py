"""A chat chunk stream as the Responses API's event stream.

Events, each `event: <type>` + `data: {"type", "sequence_number", ...}`:

    response.created, response.in_progress              (on the first chunk)
    for reasoning:   response.output_item.added, response.reasoning_text.delta ...,
                     response.reasoning_text.done, response.output_item.done
    for a message:   response.output_item.added, response.content_part.added,
                     response.output_text.delta ..., response.output_text.done,
                     response.content_part.done, response.output_item.done
    for each call:   response.output_item.added (arguments ""),
                     response.function_call_arguments.delta ...,
                     response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete            (the whole response, with usage)
    response.failed                                     (an error in the stream)

Items follow each other: an item is done before the next is added. Tool calls arrive parsed
(the chat path's tool parser), so they are only ever `function_call` items, never text. The
final response is built as the whole reply is (responses_models), and kept in `final` for the
adapter to store before the last events go out.
"""

from __future__ import annotations

from typing import Any

from tandem.edge.protocols.base import StreamTranslator, sse_event
from tandem.edge.protocols.responses_models import (
    ResponsesTranslated,
    call_item,
    failure,
    final_status,
    message_item,
    output_text,
    reasoning_item,
    response_object,
    settle,
    usage,
)


class ResponsesStream(StreamTranslator):
    def __init__(self, translated: ResponsesTranslated) -> None:
        self.translated = translated
        self.final: dict[str, Any] | None = None
        self._sequence = 0
        self._started = False
        self._ended = False
        self._model: str | None = None  # the model that answers, from the chunks
        self._items: list[dict[str, Any]] = []
        self._open: int | None = None  # output index of the item still streaming
        self._calls: dict[int, int] = {}  # chat tool-call index -> output index
        self._finish_reason: str | None = None
        self._usage: Any = None

    # --- StreamTranslator ----------------------------------------------------------------
    def feed(self, chunk: dict[str, Any]) -> list[str]:
        if self._ended:
            return []
        model = chunk.get("model")
        if self._model is None and isinstance(model, str) and model:
            self._model = model
        out: list[str] = []
        self._start(out)
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # one response per request: n is never set
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            reasoning = delta.get("reasoning_content")
            if isinstance(reasoning, str) and reasoning:
                self._reasoning(reasoning, out)
            content = delta.get("content")
            if isinstance(content, str) and content:
                self._text(content, out)
            calls = delta.get("tool_calls")
            for piece in calls if isinstance(calls, list) else []:
                if isinstance(piece, dict):
                    self._call(piece, out)
            if isinstance(choice.get("finish_reason"), str):
                self._finish_reason = choice["finish_reason"]
        return out

    def error(self, payload: dict[str, Any]) -> list[str]:
        if self._ended:
            return []
        out: list[str] = []
        self._start(out)
        self._fail(payload, out)
        return out

    def close(self) -> list[str]:
        if self._ended:
            return []
        out: list[str] = []
        self._start(out)
        if self._finish_reason is None:  # the chat stream stopped short of its end: it broke
            self._fail({"error": {"message": "the response stream ended before the response was complete",
                                  "type": "server_error", "code": "server_error"}}, out)
            return out
        status, incomplete = final_status(self._finish_reason)
        settle(self._items, status)
        self._close_open(out)
        self.final = response_object(self.translated, self._model, status, self._items,
                                     usage(self._usage), incomplete)
        self._ended = True
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self._event(kind, response=self.final))
        return out

    # --- items ---------------------------------------------------------------------------
    def _event(self, kind: str, **payload: Any) -> str:
        event = sse_event(kind, {"type": kind, "sequence_number": self._sequence, **payload})
        self._sequence += 1
        return event

    def _start(self, out: list[str]) -> None:
        if self._started:
            return
        self._started = True
        opening = response_object(self.translated, self._model, "in_progress", [], None)
        out.append(self._event("response.created", response=opening))
        out.append(self._event("response.in_progress", response=opening))

    def _text(self, delta: str, out: list[str]) -> None:
        if self._open is None or self._items[self._open]["type"] != "message":
            self._close_open(out)
            index = len(self._items)
            item = message_item(self.translated.message_id(index), "", "in_progress")
            self._items.append(item)
            self._open = index
            out.append(self._event("response.output_item.added", output_index=index,
                                   item=message_item(item["id"], None, "in_progress")))
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=output_text("")))
        index = self._open
        item = self._items[index]
        item["content"][0]["text"] += delta
        out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                               content_index=0, delta=delta, logprobs=[]))

    def _reasoning(self, delta: str, out: list[str]) -> None:
        if self._open is None or self._items[self._open]["type"] != "reasoning":
            self._close_open(out)
            index = len(self._items)
            item = reasoning_item(self.translated.reasoning_id(index), "", "in_progress")
            self._items.append(item)
            self._open = index
            out.append(self._event("response.output_item.added", output_index=index,
                                   item=reasoning_item(item["id"], None, "in_progress")))
        index = self._open
        item = self._items[index]
        item["content"][0]["text"] += delta
        out.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                               content_index=0, delta=delta))

    def _call(self, piece: dict[str, Any], out: list[str]) -> None:
        chat_index = piece.get("index", 0)
        if not isinstance(chat_index, int):
            return
        function = piece.get("function") if isinstance(piece.get("function"), dict) else {}
        name = function.get("name") if isinstance(function.get("name"), str) else ""
        if chat_index not in self._calls:
            self._close_open(out)
            index = len(self._items)
            given = piece.get("id")
            call_id = given if isinstance(given, str) and given else self.translated.call_id(index)
            item = call_item(self.translated, self.translated.call_item_id(index), call_id, name, "",
                             "in_progress")
            self._items.append(item)
            self._calls[chat_index] = index
            self._open = index
            out.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        index = self._calls[chat_index]
        item = self._items[index]
        if name and not item["name"]:  # a name that came after the call's first piece
            named = call_item(self.translated, item["id"], item["call_id"], name, "", "in_progress")
            item["name"] = named["name"]
            if "namespace" in named:
                item["namespace"] = named["namespace"]
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            item["arguments"] += arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=index, delta=arguments))

    def _close_open(self, out: list[str]) -> None:
        """The open item's done events; its status is final (settled at the end, else completed)."""
        if self._open is None:
            return
        index, self._open = self._open, None
        item = self._items[index]
        if item["status"] == "in_progress":
            item["status"] = "completed"
        if item["type"] == "reasoning":
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text, logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=output_text(text)))
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, name=item["name"], arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=index, item=item))

    def _fail(self, payload: dict[str, Any], out: list[str]) -> None:
        self._ended = True
        failed = response_object(self.translated, self._model, "failed", self._items,
                                 usage(self._usage) if self._usage is not None else None,
                                 error=failure(payload))
        out.append(self._event("response.failed", response=failed))
