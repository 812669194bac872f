"""Time stamps and nonces: a signed message is good once, and only for a short while.

A signature proves who made a message, not when: a message captured on the wire would verify
again later. So every signed message carries the sender's clock (`ts`) and a random `nonce`;
the receiver refuses a stamp more than `MAX_SKEW_S` from its own clock and a nonce it has seen
within that window. Nonces are remembered only while their stamp could still pass, so the
memory is bounded by the message rate over two windows; past `max_entries` the guard refuses
new messages rather than forgetting old ones (fail closed).
"""

from __future__ import annotations

import threading
import time

MAX_SKEW_S = 60.0
_MAX_NONCE_CHARS = 64


class ReplayGuard:
    def __init__(self, max_skew_s: float = MAX_SKEW_S, max_entries: int = 1_000_000) -> None:
        self.max_skew_s = max_skew_s
        self.max_entries = max_entries
        self._seen: dict[str, float] = {}  # nonce -> when it may be forgotten
        self._lock = threading.Lock()
        self._next_purge = 0.0

    def check(self, stamp: object, nonce: object, now: float | None = None) -> str | None:
        """Why the message must be refused (None: fresh, and now remembered)."""
        if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
            return "unstamped message"
        if not isinstance(nonce, str) or not 16 <= len(nonce) <= _MAX_NONCE_CHARS:
            return "message without a nonce"
        now = time.time() if now is None else now
        if not abs(now - float(stamp)) <= self.max_skew_s:  # `not <=` also refuses NaN
            return "stale message (clock skew or a replay)"
        with self._lock:
            if now >= self._next_purge or len(self._seen) >= self.max_entries:
                self._seen = {n: t for n, t in self._seen.items() if t > now}
                self._next_purge = now + self.max_skew_s
            if nonce in self._seen:
                return "replayed message"
            if len(self._seen) >= self.max_entries:
                return "too many messages to remember; retry shortly"
            self._seen[nonce] = float(stamp) + 2 * self.max_skew_s
        return None
