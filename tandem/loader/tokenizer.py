"""Tokenizer and chat template, from the model directory only (never a hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(hf_dir: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"no usable tokenizer in {hf_dir}: {exc}") from exc


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    if not messages:
        raise ValueError("messages must be a non-empty list")
    if tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; use generate() with a plain prompt")
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
