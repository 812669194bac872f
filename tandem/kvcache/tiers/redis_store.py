"""The cluster KV tier on Redis or Valkey: every worker writes chunks, any worker reads them.

A value is one `SET` (atomic: a reader gets all of it or nothing), under `prefix + key`; the
key already names the model and the whole prefix (chunk.py), so workers of different models
can share one server. Memory is the server's to bound: run it with `maxmemory` and
`allkeys-lru` (`tandem up --kv-store redis` does), so old chunks make room for new ones instead
of writes failing.

An unreachable or failing server raises ChunkStoreError (a miss and a recompute for the
caller), bounded by short connect and socket timeouts. After a connection failure the store
backs off for `backoff_s`: calls fail at once instead of each waiting for a timeout, so a
dead server costs one timeout per back-off period, not one per request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from urllib.parse import urlparse

import redis

from tandem.kvcache.tiers.store import ChunkStore, ChunkStoreError

_SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss", "unix": "unix"}


def normalize_url(url: str) -> str:
    """valkey:// is spoken as redis:// (the protocol is the same)."""
    scheme = urlparse(url).scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(f"not a Redis/Valkey URL: {url!r} (expected redis://HOST:PORT or valkey://HOST:PORT)")
    return _SCHEMES[scheme] + url[len(scheme):]


class RedisStore(ChunkStore):
    medium = "cluster"

    def __init__(self, url: str, prefix: str = "tandem:kv:", socket_timeout: float = 2.0,
                 connect_timeout: float = 0.5, backoff_s: float = 1.0, ttl_s: int | None = None) -> None:
        self.url = normalize_url(url)
        self.prefix = prefix
        self.backoff_s = backoff_s
        self.ttl_s = ttl_s
        pool = redis.ConnectionPool.from_url(self.url, socket_timeout=socket_timeout,
                                             socket_connect_timeout=connect_timeout)
        self._client = redis.Redis(connection_pool=pool)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._counters = {"puts": 0, "gets": 0, "hits": 0, "errors": 0, "bytes_written": 0, "bytes_read": 0}

    def _call(self, what: str, fn, *args):  # noqa: ANN001, ANN202 - a thin wrapper
        if time.monotonic() < self._down_until:
            raise ChunkStoreError(f"cluster store {self.url} is backing off after a failure")
        try:
            return fn(*args)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            with self._lock:
                self._counters["errors"] += 1
                self._down_until = time.monotonic() + self.backoff_s
            raise ChunkStoreError(f"cluster store {self.url}: {what}: {exc}") from exc
        except redis.RedisError as exc:  # e.g. OOM without an eviction policy
            with self._lock:
                self._counters["errors"] += 1
            raise ChunkStoreError(f"cluster store {self.url}: {what}: {exc}") from exc

    def put(self, key: str, value: bytes | bytearray | memoryview) -> None:
        data = value if isinstance(value, bytes | bytearray) else bytes(value)
        self._call("SET", self._client.set, self.prefix + key, data, self.ttl_s)
        with self._lock:
            self._counters["puts"] += 1
            self._counters["bytes_written"] += len(data)

    def get(self, key: str) -> bytes | None:
        value = self._call("GET", self._client.get, self.prefix + key)
        with self._lock:
            self._counters["gets"] += 1
            if value is not None:
                self._counters["hits"] += 1
                self._counters["bytes_read"] += len(value)
        return value

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []

        def probe() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.prefix + key)
            return [bool(n) for n in pipe.execute()]

        return self._call("EXISTS", probe)

    def delete(self, key: str) -> None:
        self._call("DEL", self._client.delete, self.prefix + key)

    def close(self) -> None:
        self._client.close()

    def stats(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counters)
