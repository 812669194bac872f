"""Prompt length in tokens, as the router can know it before any worker has seen the request.

The router does not render chat templates yet, so a chat prompt is the concatenated message
texts (plus tool definitions, which templates also inline): an estimate a few tokens short of
the rendered prompt, which is all scoring and the PD threshold need. With `--tokenizer` the
texts are counted with the model's `tokenizer.json` (the `tokenizers` package, no
transformers) or Kimi's `tiktoken.model` (converted into the same kind of tokenizer,
tokenization/tiktoken_tokenizer.py); without one, 4 characters per token.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4
# Encoding runs on the event loop below this many characters (well under a millisecond);
# longer texts go to a thread so one huge prompt does not stall every other stream.
_INLINE_CHARS = 8192


class PromptCounter:
    def __init__(self, tokenizer_path: Path | None = None) -> None:
        self._tokenizer: Any = None
        if tokenizer_path is not None:
            from tokenizers import Tokenizer

            from tandem.tokenization.tiktoken_tokenizer import has_tiktoken_model, tiktoken_backend

            path = Path(tokenizer_path)
            if path.is_dir() and not (path / "tokenizer.json").is_file() and has_tiktoken_model(path):
                self._tokenizer = tiktoken_backend(path)  # Kimi's tiktoken.model, converted (and cached)
                logger.info("counting prompt tokens with %s/tiktoken.model", path)
                return
            if path.is_dir():
                path = path / "tokenizer.json"
            if not path.is_file():
                raise FileNotFoundError(f"no tokenizer.json (or tiktoken.model) at {path}")
            self._tokenizer = Tokenizer.from_file(str(path))
            logger.info("counting prompt tokens with %s", path)

    @property
    def exact(self) -> bool:
        return self._tokenizer is not None

    def count_text(self, text: str) -> int:
        if not text:
            return 0
        if self._tokenizer is None:
            return max(1, len(text) // CHARS_PER_TOKEN)
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    async def count(self, body: dict[str, Any], kind: str) -> int:
        """Tokens of a chat (`kind` "chat") or completion request body's prompt."""
        if kind == "completion" and _token_id_prompt(body.get("prompt")):
            return _count_token_ids(body["prompt"])
        text = chat_text(body) if kind == "chat" else completion_text(body)
        if len(text) > _INLINE_CHARS and self._tokenizer is not None:
            return await asyncio.to_thread(self.count_text, text)
        return self.count_text(text)


def chat_text(body: dict[str, Any]) -> str:
    parts: list[str] = []
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:
            if isinstance(call, dict):
                parts.append(json.dumps(call.get("function", call)))
    if body.get("tools"):
        parts.append(json.dumps(body["tools"]))
    return "\n".join(parts)


def completion_text(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(p for p in prompt if isinstance(p, str))
    return ""


def _token_id_prompt(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and not any(isinstance(p, str) for p in prompt)


def _count_token_ids(prompt: list[Any]) -> int:
    if all(isinstance(p, int) for p in prompt):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, list))
