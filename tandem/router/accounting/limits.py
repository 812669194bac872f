"""Per-key rate limits and per-identity daily quotas: 429s in OpenAI's shape.

Rate limits are token buckets per API key (keys_store.py sets a key's own limits; the
router's `--rate-limit-rpm` / `--rate-limit-tpm` are the defaults): a bucket holds a minute's
worth and refills continuously, so a key may burst up to its per-minute figure and then goes
at the refill rate. Requests are taken one each at admission. Tokens are not known up front:
a request is admitted while its key's token bucket is not in debt, its prompt tokens (the
router's count) are taken then, and the rest when it ends (its completion, and what the
worker's exact prompt count adds), which may leave the bucket in debt; the debt delays the
next request (OpenAI's limits behave the same way from the outside).

The daily quota (`tokens_per_day`, default `--quota-tokens-per-day`) counts prompt +
completion tokens of the identity since midnight UTC in the usage ledger, so it holds across
router restarts and for several routers sharing one ledger: the ledger's sum is re-read every
`refresh_s` seconds and the tokens of requests this router finished since are added to it.

A refusal carries `Retry-After`: when the bucket will have room again, or midnight UTC.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.edge.errors import APIError
from tandem.router.accounting.auth import Caller
from tandem.router.accounting.keys_store import KeyLimits


@dataclass
class TokenBucket:
    """`per_minute` capacity, refilled at per_minute / 60 a second; the level may go negative."""

    per_minute: int
    updated: float  # when `level` was last brought up to date (monotonic seconds)
    level: float = field(init=False)

    def __post_init__(self) -> None:
        self.level = float(self.per_minute)

    @property
    def rate(self) -> float:
        return self.per_minute / 60.0

    def _refill(self, now: float) -> None:
        self.level = min(float(self.per_minute), self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` can be taken (0: now)."""
        self._refill(now)
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount


@dataclass
class _KeyBuckets:
    requests: TokenBucket | None
    tokens: TokenBucket | None


class RateLimiter:
    """The buckets of every key seen, made on first use with the key's limits."""

    def __init__(self, defaults: KeyLimits) -> None:
        self.defaults = defaults
        self._buckets: dict[str, _KeyBuckets] = {}

    def _of(self, caller: Caller, now: float) -> _KeyBuckets:
        buckets = self._buckets.get(caller.key)
        limits = caller.limits.over(self.defaults)
        if buckets is None or _stale(buckets, limits):
            buckets = _KeyBuckets(
                TokenBucket(limits.rpm, now) if limits.rpm else None,
                TokenBucket(limits.tpm, now) if limits.tpm else None,
            )
            self._buckets[caller.key] = buckets
        return buckets

    def admit(self, caller: Caller, prompt_tokens: int, now: float | None = None) -> None:
        """Take one request and the prompt's tokens, or raise a 429."""
        now = time.monotonic() if now is None else now
        buckets = self._of(caller, now)
        if buckets.requests is not None:
            wait = buckets.requests.wait_for(1, now)
            if wait > 0:
                raise _limited(
                    f"Rate limit reached: {buckets.requests.per_minute} requests per minute "
                    "for this API key",
                    "rate_limit_requests",
                    wait,
                )
        if buckets.tokens is not None:
            wait = buckets.tokens.wait_for(1e-9, now)  # admitted while not in debt
            if wait > 0:
                raise _limited(
                    f"Rate limit reached: {buckets.tokens.per_minute} tokens per minute for "
                    "this API key",
                    "rate_limit_tokens",
                    wait,
                )
        if buckets.requests is not None:
            buckets.requests.take(1, now)
        if buckets.tokens is not None:
            buckets.tokens.take(prompt_tokens, now)

    def charge(self, caller: Caller, tokens: int, now: float | None = None) -> None:
        """Tokens known only at the end: the completion, and the prompt beyond the router's
        count at admission (the worker's exact count with the chat template)."""
        buckets = self._buckets.get(caller.key)
        if buckets is not None and buckets.tokens is not None and tokens > 0:
            buckets.tokens.take(tokens, time.monotonic() if now is None else now)


def _stale(buckets: _KeyBuckets, limits: KeyLimits) -> bool:
    """The key's limits changed (the key file was edited): start fresh buckets."""
    rpm = buckets.requests.per_minute if buckets.requests else None
    tpm = buckets.tokens.per_minute if buckets.tokens else None
    return (rpm, tpm) != (limits.rpm, limits.tpm)


def _limited(message: str, code: str, wait_s: float) -> APIError:
    return APIError(429, message, None, code, headers={"Retry-After": str(max(1, math.ceil(wait_s)))})


def day_start(now: float) -> float:
    """Midnight UTC of the day `now` (unix seconds) falls in."""
    day = dt.datetime.fromtimestamp(now, dt.UTC).date()
    return dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC).timestamp()


@dataclass
class _Used:
    day: float
    ledger_tokens: int
    read_at: float
    since: int = 0  # tokens finished here after that read


class DailyQuota:
    """Tokens used today per identity: the ledger's sum plus what finished here since."""

    def __init__(
        self,
        defaults: KeyLimits,
        ledger_tokens: Callable[[str, float, float], int] | None,
        refresh_s: float = 10.0,
    ) -> None:
        self.defaults = defaults
        self._ledger_tokens = ledger_tokens  # (identity, start, end) -> tokens; blocking
        self.refresh_s = refresh_s
        self._used: dict[str, _Used] = {}

    async def check(self, caller: Caller, now: float | None = None) -> None:
        limit = caller.limits.over(self.defaults).tokens_per_day
        if limit is None:
            return
        now = time.time() if now is None else now
        used = await self.used(caller.identity, now)
        if used >= limit:
            midnight = day_start(now) + 86400
            raise _limited(
                f"Quota exceeded: {used} of {limit} tokens per day used by {caller.identity}; "
                "it resets at midnight UTC",
                "quota_exceeded",
                midnight - now,
            )

    async def used(self, identity: str, now: float) -> int:
        day = day_start(now)
        entry = self._used.get(identity)
        if entry is None or entry.day != day or now - entry.read_at >= self.refresh_s:
            tokens = 0
            if self._ledger_tokens is not None:
                tokens = await asyncio.to_thread(self._ledger_tokens, identity, day, day + 86400)
            entry = _Used(day, tokens, now)
            self._used[identity] = entry
        return entry.ledger_tokens + entry.since

    def charge(self, identity: str, tokens: int) -> None:
        entry = self._used.get(identity)
        if entry is not None:
            entry.since += tokens
