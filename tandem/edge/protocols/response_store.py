"""Where `/v1/responses` keeps the responses it answered, for `previous_response_id` and
`GET /v1/responses/{id}`.

The Responses API stores a response unless the request says `store: false`: a later request
names it as `previous_response_id` and continues the conversation without sending it again,
and `GET /v1/responses/{id}` reads it back. An entry is the whole response object (what the
GET answers), the conversation up to and including its output as Responses input items
(what a continuation prepends to its own input, so a chain of any length is one read), and
the session it belonged to (a continuation keeps the router's affinity without saying so).

Two stores behind one small interface:

- `MemoryResponseStore`: this process only, bounded in entries and bytes, least recently used
  first out. Enough for one `tandem serve`, or one router.
- `RedisResponseStore`: Redis or Valkey (redis-py's asyncio client), each entry under
  `prefix + id` with a TTL (30 days by default, as OpenAI keeps responses), so every worker
  and every router replica that shares the server continues any conversation. The server's
  own memory policy bounds it; the one `tandem up` starts evicts least recently used keys,
  KV chunks and responses alike.

Torch-free and kvcache-free: the router opens these.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

MEMORY = "memory"
# Redis-protocol URLs; valkey:// is spoken as redis:// (as the cluster KV store does).
_REDIS_SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss",
                  "unix": "unix"}
MAX_ID_LENGTH = 256  # a longer id was never ours: not looked up at all


@dataclass
class StoredResponse:
    """One stored response."""

    response: dict[str, Any]  # the whole response object, as GET /v1/responses/{id} answers
    conversation: list[dict[str, Any]]  # input items up to and including this response's output
    session: str | None = None  # the agent session it belonged to (router affinity)
    owner: str = ""  # the API-key identity that stored it ("" without keys): only it reads it

    @property
    def id(self) -> str:
        return str(self.response["id"])

    def to_json(self) -> bytes:
        # ASCII: a lone surrogate (which the HTTP edge refuses anyway) cannot break the write.
        return json.dumps({"response": self.response, "conversation": self.conversation,
                           "session": self.session, "owner": self.owner}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> StoredResponse:
        """ValueError for anything that is not an entry this module wrote."""
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("not a stored response")
        response, conversation, session = raw.get("response"), raw.get("conversation"), raw.get("session")
        owner = raw.get("owner", "")
        if not isinstance(response, dict) or not isinstance(response.get("id"), str) \
                or not isinstance(conversation, list) or not (session is None or isinstance(session, str)) \
                or not isinstance(owner, str):
            raise ValueError("not a stored response")
        return cls(response, conversation, session, owner)


class ResponseStoreError(Exception):
    """The store could not be reached or answered with an error."""


class ResponseStore(ABC):
    """Responses by id. `put` replaces an entry of the same id."""

    @abstractmethod
    async def put(self, entry: StoredResponse) -> None:
        """Keep `entry` (ResponseStoreError if the store is unreachable)."""

    @abstractmethod
    async def get(self, response_id: str) -> StoredResponse | None:
        """The entry, or None if unknown, expired or evicted (ResponseStoreError if unreachable)."""

    @abstractmethod
    async def delete(self, response_id: str) -> None:
        """Forget the entry if there is one (ResponseStoreError if unreachable)."""

    async def close(self) -> None:
        """Release connections (the app's lifespan calls it at shutdown)."""
        return None

    @abstractmethod
    def describe(self) -> str:
        """One line for the start-up log."""


@dataclass(frozen=True)
class MemoryStoreConfig:
    """Bounds of the in-process store; past either, the least recently used entries go."""

    max_entries: int = 10_000
    max_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.max_bytes < 1:
            raise ValueError("a memory response store needs max_entries and max_bytes of at least 1")


class MemoryResponseStore(ResponseStore):
    """Entries as their JSON bytes (what they cost is what is counted, and a reader never
    shares a dict with the writer), in least-recently-used order."""

    def __init__(self, config: MemoryStoreConfig | None = None) -> None:
        self.config = config or MemoryStoreConfig()
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    async def put(self, entry: StoredResponse) -> None:
        data = entry.to_json()
        key = entry.id
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= len(old)
        if len(data) > self.config.max_bytes:
            logger.warning("response %s (%d bytes) exceeds the response store's %d bytes; not stored",
                           key, len(data), self.config.max_bytes)
            return
        self._entries[key] = data
        self._bytes += len(data)
        while len(self._entries) > self.config.max_entries or self._bytes > self.config.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= len(evicted)

    async def get(self, response_id: str) -> StoredResponse | None:
        data = self._entries.get(response_id)
        if data is None:
            return None
        self._entries.move_to_end(response_id)
        return StoredResponse.from_json(data)

    async def delete(self, response_id: str) -> None:
        data = self._entries.pop(response_id, None)
        if data is not None:
            self._bytes -= len(data)

    def describe(self) -> str:
        return (f"in memory (up to {self.config.max_entries} responses, "
                f"{self.config.max_bytes / 2**20:.0f} MiB)")


@dataclass(frozen=True)
class RedisStoreConfig:
    url: str  # redis://HOST:PORT[/DB], rediss://, valkey://, valkeys://, unix:///path.sock
    prefix: str = "tandem:responses:"
    ttl_s: int = 30 * 86400  # OpenAI keeps a stored response 30 days
    socket_timeout_s: float = 2.0
    connect_timeout_s: float = 1.0
    # The server's password unless the URL names one: `tandem up`'s redis-server takes the
    # cluster secret, which every process of the cluster has.
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.ttl_s < 1:
            raise ValueError("the response store's TTL must be at least 1 second")


class RedisResponseStore(ResponseStore):
    """Entries as JSON strings under `prefix + id`, with a TTL. Nothing connects until the
    first call; a call that fails (down, timed out, an error reply) raises ResponseStoreError,
    and the caller decides what that costs (a lookup: 503; a save: a warning)."""

    def __init__(self, config: RedisStoreConfig) -> None:
        import redis.asyncio as aioredis  # only where a Redis store is configured
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.config = config
        url = redis_url(config.url)
        auth = {"password": config.password} if config.password and not urlsplit(url).password else {}
        # One retry at once: a pooled connection the server closed while idle reconnects; a
        # server that is down costs one connect timeout per call, not a series of back-offs.
        self._client = aioredis.Redis.from_url(url, socket_timeout=config.socket_timeout_s,
                                               socket_connect_timeout=config.connect_timeout_s,
                                               retry=Retry(NoBackoff(), 1), max_connections=64, **auth)

    def _key(self, response_id: str) -> str:
        return self.config.prefix + response_id

    async def put(self, entry: StoredResponse) -> None:
        import redis

        try:
            await self._client.set(self._key(entry.id), entry.to_json(), ex=self.config.ttl_s)
        except (redis.RedisError, OSError) as exc:
            raise ResponseStoreError(f"cannot store response {entry.id}: {exc}") from exc

    async def get(self, response_id: str) -> StoredResponse | None:
        import redis

        try:
            data = await self._client.get(self._key(response_id))
        except (redis.RedisError, OSError) as exc:
            raise ResponseStoreError(f"cannot read response {response_id}: {exc}") from exc
        if data is None:
            return None
        try:
            return StoredResponse.from_json(data)
        except ValueError:
            logger.warning("ignoring a malformed stored response under %s", self._key(response_id))
            return None

    async def delete(self, response_id: str) -> None:
        import redis

        try:
            await self._client.delete(self._key(response_id))
        except (redis.RedisError, OSError) as exc:
            raise ResponseStoreError(f"cannot delete response {response_id}: {exc}") from exc

    async def close(self) -> None:
        await self._client.aclose()

    def describe(self) -> str:
        parts = urlsplit(redis_url(self.config.url))
        where = parts.path if parts.scheme == "unix" else f"{parts.hostname}:{parts.port or 6379}"
        return f"on Redis at {where} (keys {self.config.prefix}*, kept {self.config.ttl_s // 86400} days)"


def is_redis_url(url: str | None) -> bool:
    """Whether `url` names a Redis/Valkey server (and not Mooncake, a file, "memory")."""
    return bool(url) and urlsplit(url or "").scheme.lower() in _REDIS_SCHEMES


def redis_url(url: str) -> str:
    """`url` as redis-py reads it: valkey:// is redis://, valkeys:// is rediss://."""
    scheme = urlsplit(url).scheme.lower()
    if scheme not in _REDIS_SCHEMES:
        raise ValueError(f"not a Redis/Valkey URL: {url!r}")
    return _REDIS_SCHEMES[scheme] + url[len(scheme):]


def check_store_url(url: str) -> None:
    """ValueError unless `url` is "memory" or a Redis/Valkey URL (the router's --response-store)."""
    if url != MEMORY and not is_redis_url(url):
        raise ValueError(f"--response-store {url!r}: expected 'memory' or redis://HOST:PORT, "
                         "rediss://, valkey://HOST:PORT, unix:///PATH")


def open_response_store(url: str | None, password: str | None = None,
                        memory: MemoryStoreConfig | None = None) -> ResponseStore:
    """The store at `url`: Redis/Valkey for such a URL, else (None, "memory") this process's."""
    if url is None or url == "" or url == MEMORY:
        return MemoryResponseStore(memory)
    check_store_url(url)
    return RedisResponseStore(RedisStoreConfig(url, password=password))
