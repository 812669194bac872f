"""The cluster KV tier on Redis or Valkey: every worker writes chunks, any worker reads them.

Why Redis: one SET is an atomic commit (a reader gets the whole value or nothing), the server
bounds its own memory (`maxmemory` with `allkeys-lru` evicts old chunks instead of failing
writes; `tandem.launch.redis_server` starts one that way), and Valkey speaks the same
protocol. Values live under `prefix + key`; keys already name the model and the whole prefix
(chunk.py), so workers of different models can share a server.

URLs: `redis://host:port[/db]`, `rediss://` (TLS), `unix:///path.sock`, and `valkey://` /
`valkeys://`, spoken as `redis://` / `rediss://`. Nothing connects until the first call, so
opening a store on a server that is down is not an error; its first call is.

Failures: a connection error, a timeout or an error reply (e.g. OOM under `noeviction`)
raises ChunkStoreError, which the caller treats as a miss and a recompute. Calls are bounded
by `connect_timeout` (establishing a connection) and `socket_timeout` (each read or write on
it), and never retried inside the client: the pool's connections are given a retry policy
of zero explicitly (a `redis.Redis(host=...)` without a pool retries 10 times with
exponential back-off in redis-py 8.1, which would multiply the time a dead server costs, and
pool defaults have changed between versions). After a connection error or a timeout the
store backs off for `backoff_s`: calls raise ChunkStoreError at once, without touching the
network, so a dead or hung server costs one timeout per back-off period rather than one per
request; the pool's connections are dropped, so the first call after the back-off connects
afresh (to a restarted server, say). An error reply does not back off: the server is up.

Thread-safe: one bounded pool of connections (`max_connections`) shared by every thread; a
thread that finds all of them busy waits up to `socket_timeout` for one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tandem.kvcache.tiers.store import ChunkStore, ChunkStoreError

_SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss",
            "unix": "unix"}
T = TypeVar("T")


def normalize_url(url: str) -> str:
    """`url` as redis-py reads it: valkey:// is redis://, valkeys:// is rediss://."""
    scheme = urlsplit(url).scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(f"not a Redis/Valkey URL: {url!r} "
                         "(expected redis://HOST:PORT[/DB], rediss://, valkey://HOST:PORT)")
    return _SCHEMES[scheme] + url[len(scheme):]


class RedisStore(ChunkStore):
    medium = "cluster"

    def __init__(self, url: str, prefix: str = "tandem:kv:", socket_timeout: float = 2.0,
                 connect_timeout: float = 0.5, ttl_s: int | None = None, backoff_s: float = 1.0,
                 max_connections: int = 32, password: str | None = None) -> None:
        self.url = normalize_url(url)
        # The URL's own password wins; else `password` (the cluster secret) if given.
        auth = {} if password is None or redis.connection.parse_url(self.url).get("password") \
            else {"password": password}
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.backoff_s = backoff_s
        self._pool = redis.BlockingConnectionPool.from_url(
            self.url, max_connections=max_connections, timeout=socket_timeout,
            socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 0), **auth)
        self._client = redis.Redis(connection_pool=self._pool)
        self._lock = threading.Lock()  # the counters and the back-off deadline
        self._down_until = 0.0
        self._counters = {"puts": 0, "gets": 0, "hits": 0, "errors": 0, "backoffs": 0,
                          "bytes_put": 0, "bytes_got": 0}

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        if time.monotonic() < self._down_until:
            raise ChunkStoreError(f"cluster store {self.url} is backing off after a failure "
                                  f"(retrying within {self.backoff_s:g} s)")
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            with self._lock:
                self._counters["errors"] += 1
                self._counters["backoffs"] += 1
                self._down_until = time.monotonic() + self.backoff_s
            self._pool.disconnect()  # drop sockets to the failed server: reconnect afresh
            raise ChunkStoreError(f"cluster store {self.url}: {what}: "
                                  f"{type(exc).__name__}: {exc}") from exc
        except redis.RedisError as exc:  # an error reply, e.g. OOM under noeviction
            with self._lock:
                self._counters["errors"] += 1
            raise ChunkStoreError(f"cluster store {self.url}: {what}: "
                                  f"{type(exc).__name__}: {exc}") from exc

    # --- the interface ------------------------------------------------------------------
    def put(self, key: str, value: bytes | bytearray | memoryview) -> None:
        view = memoryview(value)  # no copy; redis-py sends a large value as its own buffer
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self._call("SET", lambda: self._client.set(self.prefix + key, view, ex=self.ttl_s))
        with self._lock:
            self._counters["puts"] += 1
            self._counters["bytes_put"] += view.nbytes

    def get(self, key: str) -> bytes | None:
        value: bytes | None = self._call("GET", lambda: self._client.get(self.prefix + key))
        with self._lock:
            self._counters["gets"] += 1
            if value is not None:
                self._counters["hits"] += 1
                self._counters["bytes_got"] += len(value)
        return value

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []

        def probe() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)  # one round trip for all keys
            for key in keys:
                pipe.exists(self.prefix + key)
            return [bool(n) for n in pipe.execute()]

        return self._call("EXISTS", probe)

    def count_sightings(self, keys: Sequence[str], ttl_s: int = 3600) -> list[int]:
        """Add one sighting to each key, cluster-wide, and return the counts (INCR with an
        expiry, one round trip): the admission filter's "seen in N requests" then counts the
        requests of every worker, so round-robin routing does not keep a session's chunks out
        of the store until one worker happens to see them twice."""
        if not keys:
            return []

        def incr() -> list[int]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.incr(self.prefix + "seen:" + key)
                pipe.expire(self.prefix + "seen:" + key, ttl_s)
            return [int(n) for n in pipe.execute()[::2]]

        return self._call("INCR", incr)

    def delete(self, key: str) -> None:
        self._call("DEL", lambda: self._client.delete(self.prefix + key))

    def close(self) -> None:
        self._pool.disconnect()

    def stats(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counters)
