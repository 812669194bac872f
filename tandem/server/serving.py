"""What every endpoint shares: the engine client, the tokenizer, checks and response pieces."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tandem.config import ServerConfig
from tandem.edge.drain import Drain
from tandem.edge.errors import APIError, bad_request, error_body
from tandem.edge.openai_protocol import SamplingFields
from tandem.server.engine_client import (
    AsyncEngineClient,
    EngineDeadError,
    EngineRequestError,
    Handoff,
)
from tandem.server.metrics import ServerMetrics
from tandem.server.reasoning import ReasoningParser
from tandem.server.tool_parsers import ToolParser
from tandem.types import SamplingParams, TokenLogprob

logger = logging.getLogger(__name__)

T = TypeVar("T")

@dataclass
class ServingState:
    config: ServerConfig
    client: AsyncEngineClient
    tokenizer: Any
    model_names: tuple[str, ...]
    metrics: ServerMetrics
    tool_parser: ToolParser
    drain: Drain = field(default_factory=Drain)
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser: <think> apart from the answer
    created: int = field(default_factory=lambda: int(time.time()))
    _token_text: dict[int, str] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def preserved_token_ids(self) -> list[int]:
        """The ids of the tool parser's markers that are added tokens of this vocabulary (only
        those can be special and skipped)."""
        if not self.tool_parser.preserved_tokens:
            return []
        added = {token.content: i for i, token in self.tokenizer.added_tokens_decoder.items()}
        return [added[token] for token in self.tool_parser.preserved_tokens if token in added]

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    # --- checks, in the order a request meets them ----------------------------------
    def check_model(self, requested: str | None) -> str:
        if requested is None or requested == "" or requested in self.model_names:
            return requested or self.model_name
        raise APIError(404, f"The model `{requested}` does not exist; this server serves "
                            f"{', '.join(self.model_names)}.", "model", "model_not_found")

    @property
    def max_waiting_tokens(self) -> int:
        """Prompt tokens that may wait at once (0: no limit); by default 64 contexts' worth."""
        limit = self.config.max_waiting_tokens
        return 64 * self.max_model_len if limit is None else limit

    def check_admission(self, request_ids: list[str], sequences_each: int, prompt_tokens: list[int]) -> None:
        """Admit a request of len(request_ids) prompts x `sequences_each` sequences, counted
        against --max-waiting sequences and --max-waiting-tokens prompt tokens together with
        what already waits, before anything is queued: 429 (Retry-After) when it does not fit
        now, 400 when it never could. Admitted, it counts as waiting at once (engine_client
        `reserve`), so a burst cannot slip past between admission and queueing."""
        if not self.client.healthy:  # before draining: a dead engine also stops its server
            raise APIError(503, "the engine is not running", None, "engine_dead")
        if self.drain.draining:
            raise self.drain.refusal("this worker")
        sequences, tokens = len(request_ids) * sequences_each, sum(prompt_tokens)
        waiting_sequences, waiting_tokens = self.client.queued()
        for asked, waiting, limit, what, flag in (
                (sequences, waiting_sequences, self.config.max_waiting, "sequences (prompts x n)", "--max-waiting"),
                (tokens, waiting_tokens, self.max_waiting_tokens, "prompt tokens", "--max-waiting-tokens")):
            if not limit:
                continue
            if asked > limit:
                raise APIError(400, f"this request asks for {asked} {what}; this server queues at most {limit} "
                                    f"({flag}): send it in smaller parts", None, "request_too_large")
            if waiting + asked > limit:
                raise APIError(429, f"the server is at capacity ({waiting} {what} waiting, limit {limit}); "
                                    "retry shortly", None, "overloaded", headers={"Retry-After": "1"})
        for request_id, count in zip(request_ids, prompt_tokens, strict=True):
            self.client.reserve(request_id, sequences_each, count)

    def check_prompt(self, prompt_token_ids: list[int], max_tokens: int | None, param: str) -> int:
        """The max_tokens to run with: the request's (capped at what is left of the context
        under --max-tokens-policy cap), or for a request that names none the server's
        max_new_tokens default, at most the context's rest."""
        if not prompt_token_ids:
            raise bad_request("the prompt is empty", param, "empty_prompt")
        vocab = self.client.info.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", param, "invalid_token_id")
        limit = self.max_model_len
        prompt_len = len(prompt_token_ids)
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens", "invalid_value")
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, and the prompt has {prompt_len}: "
                "no room is left for a completion. Please shorten the prompt.", param, "context_length_exceeded")
        if max_tokens is None:  # the server's default (--override-generation-config), or the context's rest
            default = self.config.generation_defaults.max_new_tokens
            return min(default, limit - prompt_len) if default else limit - prompt_len
        if max_tokens is not None and prompt_len + max_tokens > limit and self.config.max_tokens_policy == "cap":
            return limit - prompt_len
        if prompt_len + (max_tokens or 1) > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + (max_tokens or 0)} tokens ({prompt_len} in the prompt, {max_tokens or 0} "
                "in the completion). Please reduce the length of the prompt or the completion.",
                param, "context_length_exceeded")
        return max_tokens

    @staticmethod
    def max_tokens_headers(requested: int | None, applied: int) -> dict[str, str]:
        """What a capped request is told: the max_tokens it ran with and the one it asked for."""
        if requested is None or applied >= requested:
            return {}
        return {"x-tandem-max-tokens-applied": str(applied), "x-tandem-max-tokens-requested": str(requested)}

    def sampling_params(self, request: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams, checked against this model's vocabulary too (top_k,
        stop_token_ids): a 400 naming the field for anything out of range."""
        if request.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias", "unsupported")
        defaults = {name: value for name, value in self.config.generation_defaults.sampling_fields().items()
                    if name not in request.model_fields_set}
        if defaults:  # only what the request left out
            request = request.model_copy(update=defaults)
        try:
            return request.sampling_params(max_tokens, logprobs, vocab_size=self.client.info.vocab_size)
        except ValueError as exc:
            param = str(exc).split(" ", 1)[0]
            raise bad_request(str(exc), param if param.isidentifier() else None, "invalid_value") from exc

    def handoff(self, kv_transfer_params: dict[str, Any] | None, params: SamplingParams, stream: bool,
                from_peer: bool) -> Handoff | None:
        """The request's part in a prefill/decode handoff, checked before it reaches the engine.

        The field is internal (tandem/trust/fields.py): only a peer-signed request may carry it."""
        if kv_transfer_params is None:
            return None
        param = "kv_transfer_params"
        if not from_peer:
            raise APIError(403, "kv_transfer_params is set by tandem's router between its own workers; a client "
                                "may not send it (requests carrying it must be signed with the cluster secret)",
                           param, "internal_field")
        if not kv_transfer_params:
            return None
        if params.n != 1:
            raise bad_request("a prefill/decode handoff needs n == 1", param, "invalid_value")
        if kv_transfer_params.get("do_remote_decode"):
            if stream:
                raise bad_request("the prefill half of a handoff is not streamed", param, "invalid_value")
            return Handoff(kv_transfer_params={"do_remote_decode": True})
        if kv_transfer_params.get("do_remote_prefill"):
            first = kv_transfer_params.get("first_token_ids")
            vocab = self.client.info.vocab_size
            if (not isinstance(first, list) or not first
                    or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in first)):
                raise bad_request(f"kv_transfer_params.first_token_ids must be a non-empty list of token ids in "
                                  f"[0, {vocab})", param, "invalid_value")
            if params.max_tokens is not None and params.max_tokens <= len(first):
                raise bad_request("max_tokens must exceed the tokens already generated by the prefill worker",
                                  "max_tokens", "invalid_value")
            streamed_from = kv_transfer_params.get("streamed_from")
            if streamed_from is not None and (not isinstance(streamed_from, int) or isinstance(streamed_from, bool)
                                              or not 0 <= streamed_from <= len(first)):
                raise bad_request("kv_transfer_params.streamed_from must be an index into first_token_ids",
                                  param, "invalid_value")
            own = ("first_token_ids", "emit_first_token", "streamed_from")
            handle = {k: v for k, v in kv_transfer_params.items() if k not in own}
            return Handoff(kv_transfer_params=handle if handle.get("transfer_id") else None,
                           prior_output_ids=list(first), emit_prior=bool(kv_transfer_params.get("emit_first_token")),
                           streamed_from=streamed_from)
        raise bad_request("kv_transfer_params needs do_remote_decode or do_remote_prefill", param, "invalid_value")

    def handoff_reply(self, handoff: Handoff | None, kv_transfer: dict[str, Any] | None, finish_reason: str | None,
                      token_ids: list[int], loaded_tokens: int) -> dict[str, Any] | None:
        """The `kv_transfer_params` a handoff request's response carries."""
        if handoff is None:
            return None
        if handoff.prefill_side:
            if kv_transfer is None:
                return None
            if finish_reason != "length":  # the output ended at its first token: nothing to continue
                self.client.release_transfer(kv_transfer["transfer_id"])
                return None
            return {**kv_transfer, "first_token_ids": token_ids}
        return {"adopted_blocks": loaded_tokens // self.client.info.block_size}

    # --- text ---------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def chat_logprobs(self, entries: list[list[TokenLogprob]]) -> list[dict[str, Any]]:
        """OpenAI chat `logprobs.content`: the sampled token first, then its top alternatives."""
        content = []
        for entry in entries:
            chosen, top = entry[0], entry[1:]
            content.append({
                **self._logprob_item(chosen),
                "top_logprobs": [self._logprob_item(t) for t in top],
            })
        return content

    def _logprob_item(self, item: TokenLogprob) -> dict[str, Any]:
        text = self.token_text(item.token_id)
        logprob = max(item.logprob, -9999.0)  # JSON has no -inf
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_error(exc: Exception) -> str:
    """An error after the stream began: OpenAI sends it as one more data event."""
    if isinstance(exc, APIError):
        return sse(exc.body())
    status = 400 if isinstance(exc, EngineRequestError) else 503 if isinstance(exc, EngineDeadError) else 500
    return sse(error_body(status, str(exc) or type(exc).__name__))


async def sse_events(events: AsyncIterator[str], on_end: Callable[[], None]) -> AsyncIterator[str]:
    """The body of a streamed response: its events, then `[DONE]`.

    The status line went out with the first event, so a later failure becomes one more
    event in OpenAI's error shape. `on_end` runs however the stream ends, a client that
    left included (its metrics are observed once, there).
    """
    try:
        async with aclosing(events):
            async for event in events:
                yield event
        yield SSE_DONE
    except Exception as exc:
        yield stream_error(as_api_error(exc))
        yield SSE_DONE
    finally:
        on_end()


def as_api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineRequestError):
        return bad_request(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), None, "engine_dead")
    logger.exception("request failed")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive; (stream index, item)."""
    queue: asyncio.Queue[tuple[int, T] | tuple[int, Exception] | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as exc:  # delivered to the consumer, which re-raises it
            await queue.put((index, exc))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            entry = await queue.get()
            if entry is None:
                remaining -= 1
                continue
            index, item = entry
            if isinstance(item, Exception):
                raise item
            yield index, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

