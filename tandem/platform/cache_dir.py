"""Where tandem keeps what it builds once per machine (converted models and vocabularies,
compiled kernels): `$TANDEM_CACHE_DIR`, else `$XDG_CACHE_HOME/tandem`, else ~/.cache/tandem.
Torch-free, so the router side can find the same files."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tandem"
    )
    return Path(root)
