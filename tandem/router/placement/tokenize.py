"""The tokenize hop: a worker's `POST /tokenize` gives the prompt's exact token ids.

kv_aware routing hashes the prompt into KV blocks, which needs the tokens exactly as a worker
would compute them: the model's chat template, tool rendering and special tokens. The router
does not render templates itself (that would need the model's Jinja template and its quirks),
so it asks a worker, one local round trip of a few milliseconds. Any failure or a reply slower
than the timeout returns None, and the request is routed by load instead: the hop may make
routing better, never make a request fail.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from tandem.router.workers.registry import WorkerEndpoint

logger = logging.getLogger(__name__)

_CHAT_FIELDS = (
    "messages",
    "tools",
    "tool_choice",
    "add_generation_prompt",
    "continue_final_message",
    "model",
)


def tokenize_body(body: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The /tokenize request for a chat or completion body; None when it has no one prompt."""
    if kind == "chat":
        if not isinstance(body.get("messages"), list):
            return None
        out = {k: body[k] for k in _CHAT_FIELDS if body.get(k) is not None}
        out.setdefault("add_generation_prompt", True)
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    out = {"prompt": prompt}
    if isinstance(body.get("model"), str):
        out["model"] = body["model"]
    return out


def token_id_prompt(body: dict[str, Any], kind: str) -> list[int] | None:
    """A completion prompt given as token ids needs no hop. Ids no vocabulary has (negative,
    or past 32 bits: block hashes pack them as such) are the worker's to refuse, with a 400;
    such a request is routed by load."""
    prompt = body.get("prompt") if kind == "completion" else None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in prompt
    ):
        return prompt
    return None


class RemoteTokenizer:
    def __init__(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        self.client = client
        self.timeout_s = timeout_s

    async def tokens(
        self, worker: WorkerEndpoint, request: dict[str, Any], headers: dict[str, str]
    ) -> list[int] | None:
        try:
            async with asyncio.timeout(self.timeout_s):  # in all: connect, send and read
                response = await self.client.post(
                    f"{worker.url}/tokenize",
                    json=request,
                    headers=headers,
                    timeout=httpx.Timeout(self.timeout_s),
                )
        except TimeoutError:
            logger.debug("POST %s/tokenize took over %g s", worker.url, self.timeout_s)
            return None
        except httpx.HTTPError as exc:
            logger.debug("POST %s/tokenize failed: %s", worker.url, exc)
            return None
        if response.status_code != 200:
            logger.debug("POST %s/tokenize answered %d", worker.url, response.status_code)
            return None
        try:
            tokens = response.json().get("tokens")
        except (ValueError, AttributeError):
            return None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        return tokens
