"""A step's token masks, computed on a helper thread while the step's forward runs.

The scheduler asks for the masks when it has scheduled a step; llguidance fills them with the
GIL released, so on the engine core's own rank they are computed while the model runs and the
runner waits only for what is left when it reaches sampling (`resolve`). Pickled for a rank in
another process, the masks are resolved first: that rank gets plain arrays.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np

MaskRows = dict[str, np.ndarray]  # request id -> int32 [rows, words]: bit t of a row allows token t


class PendingMasks:
    """The masks of one step's constrained requests: one row per token they sample (a request
    verifying k drafts samples k + 1 times)."""

    def __init__(self, future: Future[MaskRows] | None = None, rows: MaskRows | None = None) -> None:
        self._future = future
        self._rows = rows

    def resolve(self) -> MaskRows:
        """The masks, waiting for the helper thread if it is still filling them."""
        if self._rows is None:
            assert self._future is not None
            self._rows = self._future.result()
            self._future = None
        return self._rows

    def __getstate__(self) -> dict[str, Any]:
        return {"rows": self.resolve()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._future = None
        self._rows = state["rows"]
