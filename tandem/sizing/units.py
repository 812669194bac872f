"""Memory sizes as people write them ('2GiB', '512MB', '1.5g', a byte count), read by the
flags and the memory model alike. Imports nothing from tandem: `tandem.config` re-exports it."""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_memory_size(text: str | int) -> int:
    """Parse '2GiB', '512MB', '1.5g' or a plain byte count into bytes (binary units)."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"cannot read memory size {text!r}; use e.g. 2GiB, 512MiB or a byte count")
    number, unit, _ = match.groups()
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit.lower()]
    return int(float(number) * scale)
