"""Tokenizer and chat template, from the model directory only (never a hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast


def load_tokenizer(hf_dir: Path) -> PreTrainedTokenizerBase:
    """The fast tokenizer straight from tokenizer.json when there is one.

    AutoTokenizer resolves the class through the model config machinery first, which costs
    over a second of a start-up budget of a few; the fast class reads the same files.
    """
    try:
        if (hf_dir / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(str(hf_dir), local_files_only=True)
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
