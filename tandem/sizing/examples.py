"""The example configs shipped with tandem, and finding a config.json by path or example name.

`configs/<name>/config.json` are published models' config files (where each comes from is in
`configs/README.md`), kept as package data so `tandem plan memory kimi-k2` works from an
installed wheel or the Docker image, from any directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.sizing.errors import PlanError

EXAMPLES_DIR = Path(__file__).resolve().parent / "configs"
EXAMPLE_NAMES = ("kimi-k2", "kimi-k2.5", "deepseek-v3", "llama-3.1-8b", "llama-3.1-70b", "llama-4-scout",
                 "qwen3-235b-a22b")


def load_config(spec: str) -> tuple[str, dict[str, Any]]:
    """(display name, config dict) for a path, a directory holding config.json, or an example name."""
    path = Path(spec)
    if spec in EXAMPLE_NAMES and not path.exists():
        path = EXAMPLES_DIR / spec
        name = spec
    else:
        # a model directory's name, or a file's own name unless it is the usual config.json
        name = path.name if path.is_dir() else (path.parent.name if path.name == "config.json" else path.stem)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanError(f"no config.json at {spec!r}; give a path to a config.json, a directory "
                        f"holding one, or an example name: {', '.join(EXAMPLE_NAMES)}")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise PlanError(f"{path} is not a JSON object")
    return name, config
