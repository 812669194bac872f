"""Make two workers' halves of a request look like one response (pure functions on dicts).

Prefill/decode disaggregation answers a request with two worker responses: the prefill
worker's one-token completion and the decode worker's continuation. The client must see one
`id` and one `created` (the router's), every token once and in order, the finish reason from
the end, and usage counted once: prompt tokens and cached tokens from the prefill worker (the
one that read the prompt: the decode worker's cache hits are on blocks it was just sent), and
completion tokens from the decode worker (whose count includes the first token). Summing the
two workers' cached tokens is the common PD bug (llm-d-router #1012, vLLM #44607).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["chat", "completion"]
SSE_DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class Identity:
    """The id, created and model of the response the client sees."""

    id: str
    created: int
    model: str
    kind: Kind

    @classmethod
    def new(cls, kind: Kind, model: str) -> Identity:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model, kind)

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def stamp(self, payload: dict[str, Any]) -> dict[str, Any]:
        out = dict(payload)
        out["id"] = self.id
        out["created"] = self.created
        if self.model:
            out["model"] = self.model
        return out


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _cached(usage: dict[str, Any] | None) -> int:
    details = (usage or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def merged_usage(prefill: dict[str, Any] | None, decode: dict[str, Any]) -> dict[str, Any]:
    """Prompt and cached tokens from the prefill hop, completion tokens from the decode hop."""
    if prefill is None:
        return decode
    prompt = int(prefill.get("prompt_tokens") or 0)
    completion = int(decode.get("completion_tokens") or 0)
    out = dict(decode)
    out["prompt_tokens"] = prompt
    out["completion_tokens"] = completion
    out["total_tokens"] = prompt + completion
    # Every prompt figure is the prefill worker's: cached tokens, and the tokens written up to
    # a cache breakpoint (cache_write_tokens) where the request had one.
    out["prompt_tokens_details"] = {
        **(decode.get("prompt_tokens_details") or {}),
        **(prefill.get("prompt_tokens_details") or {}),
        "cached_tokens": _cached(prefill),
    }
    return out


def rewrite_reply(
    reply: dict[str, Any], identity: Identity, prefill_usage: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A whole (non-streamed) worker reply under the router's identity, usage merged."""
    out = identity.stamp(reply)
    out.pop("kv_transfer_params", None)
    if isinstance(reply.get("usage"), dict):
        out["usage"] = merged_usage(prefill_usage, reply["usage"])
    return out


def first_text(reply: dict[str, Any]) -> str:
    """The text of a one-choice reply (the prefill hop's first token)."""
    choices = reply.get("choices") or [{}]
    choice = choices[0]
    if "message" in choice:
        return (choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


def finish_reason(reply: dict[str, Any]) -> str | None:
    choices = reply.get("choices") or [{}]
    return choices[0].get("finish_reason")


# --- streams ------------------------------------------------------------------------
def _chunk(
    identity: Identity, choices: list[dict[str, Any]], include_usage: bool
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "id": identity.id,
        "object": identity.chunk_object,
        "created": identity.created,
        "model": identity.model,
        "choices": choices,
    }
    if include_usage:
        payload["usage"] = None
    return payload


def usage_chunk(identity: Identity, usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": identity.id,
        "object": identity.chunk_object,
        "created": identity.created,
        "model": identity.model,
        "choices": [],
        "usage": usage,
    }


def role_chunk(identity: Identity, include_usage: bool) -> dict[str, Any]:
    return _chunk(
        identity,
        [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        include_usage,
    )


def text_chunk(
    identity: Identity, text: str, include_usage: bool, reason: str | None = None
) -> dict[str, Any]:
    if identity.kind == "chat":
        delta = {"content": text} if text else {}
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": reason,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": None,
        }
    return _chunk(identity, [choice], include_usage)


def reply_to_chunks(
    reply: dict[str, Any], identity: Identity, include_usage: bool
) -> list[dict[str, Any]]:
    """A whole reply as the chunks a streaming client expects (role, text, tool calls, end)."""
    chunks: list[dict[str, Any]] = []
    choices = reply.get("choices") or []
    if identity.kind == "chat":
        chunks.append(
            _chunk(
                identity,
                [
                    {
                        "index": c.get("index", i),
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i, c in enumerate(choices)
                ],
                include_usage,
            )
        )
    for i, choice in enumerate(choices):
        index = choice.get("index", i)
        if identity.kind == "chat":
            message = choice.get("message") or {}
            if message.get("content"):
                chunks.append(
                    _chunk(
                        identity,
                        [
                            {
                                "index": index,
                                "delta": {"content": message["content"]},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        include_usage,
                    )
                )
            calls = message.get("tool_calls") or []
            if calls:
                pieces = [
                    {
                        "index": n,
                        "id": call.get("id"),
                        "type": call.get("type", "function"),
                        "function": dict(call.get("function") or {}),
                    }
                    for n, call in enumerate(calls)
                ]
                chunks.append(
                    _chunk(
                        identity,
                        [
                            {
                                "index": index,
                                "delta": {"tool_calls": pieces},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        include_usage,
                    )
                )
            chunks.append(
                _chunk(
                    identity,
                    [
                        {
                            "index": index,
                            "delta": {},
                            "logprobs": None,
                            "finish_reason": choice.get("finish_reason"),
                            "stop_reason": choice.get("stop_reason"),
                        }
                    ],
                    include_usage,
                )
            )
        else:
            chunks.append(
                _chunk(
                    identity,
                    [
                        {
                            "index": index,
                            "text": choice.get("text") or "",
                            "logprobs": None,
                            "finish_reason": choice.get("finish_reason"),
                            "stop_reason": choice.get("stop_reason"),
                        }
                    ],
                    include_usage,
                )
            )
    if include_usage and isinstance(reply.get("usage"), dict):
        chunks.append(usage_chunk(identity, reply["usage"]))
    return chunks


def has_output(chunk: dict[str, Any]) -> bool:
    """Whether a chunk carries generated output (text or a tool-call piece): TTFT's event."""
    for choice in chunk.get("choices") or []:
        if choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls"):
            return True
    return False


class ChunkRewriter:
    """Rewrites a worker's stream chunks for the client, one chunk at a time.

    The router always asks workers for usage (so it can count tokens); `include_usage` says
    whether the client asked, and if not the usage fields and the usage-only chunk go.
    `drop_role` removes the worker's role delta when the router already sent one.
    `on_usage` decorates the merged usage (the router adds its price there).
    Workers report each chunk's `token_ids` when the router asks (to move a broken stream);
    unless `keep_token_ids` (the client asked too) they go, and a choice left with nothing
    to say goes with them.
    """

    def __init__(
        self,
        identity: Identity,
        include_usage: bool,
        drop_role: bool,
        prefill_usage: dict[str, Any] | None = None,
        on_usage: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        keep_token_ids: bool = False,
    ) -> None:
        self.keep_token_ids = keep_token_ids
        self.identity = identity
        self.include_usage = include_usage
        self.drop_role = drop_role
        self.prefill_usage = prefill_usage
        self.on_usage = on_usage
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None

    def __call__(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        out = self.identity.stamp(chunk)
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            usage = merged_usage(self.prefill_usage, usage)
            if self.on_usage is not None:
                usage = self.on_usage(usage)
            self.usage = usage
        if self.include_usage:
            out["usage"] = usage
        else:
            out.pop("usage", None)
        choices = chunk.get("choices")
        if not choices:
            return out if self.include_usage and usage is not None else None
        kept = []
        for choice in choices:
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
            if self.drop_role and "role" in (choice.get("delta") or {}):
                choice = _without_role(choice)
                if choice is None:
                    continue
            if not self.keep_token_ids and "token_ids" in choice:
                choice = {k: v for k, v in choice.items() if k != "token_ids"}
                if _says_nothing(choice):
                    continue
            kept.append(choice)
        if not kept:
            return None
        out["choices"] = kept
        return out


def _without_role(choice: dict[str, Any]) -> dict[str, Any] | None:
    delta = {k: v for k, v in (choice.get("delta") or {}).items() if k != "role"}
    if delta.get("content") == "":
        del delta["content"]
    if not delta and choice.get("finish_reason") is None and choice.get("logprobs") is None:
        return None
    return {**choice, "delta": delta}


def _says_nothing(choice: dict[str, Any]) -> bool:
    """A choice with no text, delta, end or logprobs (it carried only token ids)."""
    if choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
        return False
    if "delta" in choice:
        return not any(v not in (None, "") for v in (choice.get("delta") or {}).values())
    return not choice.get("text")
