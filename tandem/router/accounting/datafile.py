"""Read the router's small operator files (prices, API keys) as JSON or YAML.

One loader so every file gives the same kind of error: the file's name and what is wrong
with it, raised as ValueError at start-up rather than as a surprise on the first request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def parse_structured(text: str, suffix: str, what: str) -> Any:
    """JSON, or YAML for a .yaml / .yml suffix; None for an empty file."""
    if suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as exc:  # pragma: no cover - PyYAML is a dependency
            raise ValueError(f"{what}: YAML needs PyYAML (pip install pyyaml)") from exc
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{what} is not valid YAML: {exc}") from exc
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from exc


def read_text(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise ValueError(f"{what} not found: {path}") from None
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
