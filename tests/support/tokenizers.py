"""Test tokenizers made from the default model's: SmolLM2's vocabulary with other models'
special tokens added, or another chat template, for dialect tests without those models."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.loader.resolve import resolve_model
from tandem.loader.tokenizer import Tokenizer


def smollm_tokenizer_with(directory: Path, special_tokens: Sequence[str] = (),
                          chat_template: str | None = None) -> Tokenizer:
    """SmolLM2's tokenizer saved in `directory` with `special_tokens` added as special added
    tokens (as Kimi's or DeepSeek's vocabulary holds its tool-call markers) and, if given,
    `chat_template` in place of its own."""
    source = resolve_model("smollm2-135m").hf_dir
    data = json.loads((source / "tokenizer.json").read_text())
    next_id = max(len(data["model"]["vocab"]), *(t["id"] + 1 for t in data["added_tokens"]))
    for offset, token in enumerate(special_tokens):
        data["added_tokens"].append({"id": next_id + offset, "content": token, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    (directory / "tokenizer.json").write_text(json.dumps(data))
    if chat_template is None:
        shutil.copy(source / "tokenizer_config.json", directory / "tokenizer_config.json")
    else:
        config = json.loads((source / "tokenizer_config.json").read_text())
        (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template}))
    return Tokenizer.from_directory(directory)


@functools.lru_cache(maxsize=1)
def smollm_llg_tokenizer() -> Any:
    """llguidance's view of SmolLM2's vocabulary (built once: about a second)."""
    import llguidance

    from tandem.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model("smollm2-135m").hf_dir)
    return llguidance.LLTokenizer(tokenizer.backend_tokenizer.to_str())
