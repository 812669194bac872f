"""The response store (tandem/edge/protocols/response_store.py): the bounded in-memory one, and
the Redis one against a real redis-server (the managed one `tandem up` starts, with a password)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tandem.edge.protocols.response_store import (
    MemoryResponseStore,
    MemoryStoreConfig,
    RedisResponseStore,
    RedisStoreConfig,
    ResponseStoreError,
    StoredResponse,
    check_store_url,
    is_redis_url,
    open_response_store,
)
from tandem.launch.redis_server import RedisServer
from tandem.platform.ports import free_port

PASSWORD = "response-store-test-secret"


def entry(response_id: str, text: str = "hi", session: str | None = None) -> StoredResponse:
    response = {"id": response_id, "object": "response", "output": [{"type": "message", "content": text}]}
    return StoredResponse(response, [{"type": "message", "role": "user", "content": "q"}, *response["output"]],
                          session)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# --- memory ------------------------------------------------------------------------------


def test_memory_round_trip_is_a_copy() -> None:
    store = MemoryResponseStore()
    kept = entry("resp_1", "héllo 🙂", "s1")
    run(store.put(kept))
    got = run(store.get("resp_1"))
    assert got == kept and got is not kept
    got.response["id"] = "changed"  # a reader cannot change what is stored
    assert run(store.get("resp_1")) == kept
    assert run(store.get("resp_2")) is None


def test_memory_evicts_the_least_recently_used_past_its_entry_bound() -> None:
    store = MemoryResponseStore(MemoryStoreConfig(max_entries=3))

    async def main() -> list[str]:
        for name in "abc":
            await store.put(entry(name))
        await store.get("a")  # a is now the most recently used
        await store.put(entry("d"))
        return [name for name in "abcd" if await store.get(name) is not None]

    assert run(main()) == ["a", "c", "d"] and len(store) == 3


def test_memory_evicts_past_its_byte_bound_and_counts_exactly() -> None:
    size = len(entry("a", "x" * 100).to_json())
    store = MemoryResponseStore(MemoryStoreConfig(max_bytes=2 * size + 10))

    async def main() -> None:
        await store.put(entry("a", "x" * 100))
        await store.put(entry("b", "x" * 100))
        assert store.num_bytes == 2 * size and len(store) == 2
        await store.put(entry("c", "x" * 100))
        assert await store.get("a") is None and len(store) == 2 and store.num_bytes == 2 * size
        await store.put(entry("b", "y" * 100))  # replacing counts the new size only
        assert store.num_bytes == 2 * size and (await store.get("b")).response["output"][0]["content"] == "y" * 100
        await store.put(entry("huge", "z" * 10 * size))  # larger than the bound: not kept, nothing evicted
        assert await store.get("huge") is None and len(store) == 2

    run(main())


def test_memory_delete_forgets_and_gives_back_the_bytes() -> None:
    store = MemoryResponseStore()

    async def main() -> None:
        await store.put(entry("a"))
        await store.put(entry("b"))
        size_b = store.num_bytes - len(entry("a").to_json())
        await store.delete("a")
        await store.delete("never-stored")  # nothing to forget: no error
        assert await store.get("a") is None and len(store) == 1 and store.num_bytes == size_b

    run(main())


def test_the_owner_survives_a_round_trip_and_a_bad_one_is_refused() -> None:
    owned = StoredResponse(entry("a").response, [], None, owner="alice")
    assert StoredResponse.from_json(owned.to_json()).owner == "alice"
    raw = json.loads(owned.to_json())
    del raw["owner"]  # written before owners were kept: nobody's
    assert StoredResponse.from_json(json.dumps(raw)).owner == ""
    with pytest.raises(ValueError):
        StoredResponse.from_json(json.dumps({**raw, "owner": 7}))


def test_urls() -> None:
    assert isinstance(open_response_store(None), MemoryResponseStore)
    assert isinstance(open_response_store("memory"), MemoryResponseStore)
    for url in ("redis://h:1", "valkey://h:1/2", "rediss://h", "unix:///tmp/r.sock"):
        assert is_redis_url(url)
        check_store_url(url)
    for url in ("mooncake://m:1", "http://h", "h:1", "", None):
        assert not is_redis_url(url)
    with pytest.raises(ValueError, match="response-store"):
        check_store_url("mooncake://m:1")
    with pytest.raises(ValueError):
        MemoryStoreConfig(max_entries=0)


# --- Redis -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server(redis_binary: str) -> Iterator[RedisServer]:
    with RedisServer(password=PASSWORD) as server:
        yield server


def redis_store(server: RedisServer, **config: Any) -> RedisResponseStore:
    return RedisResponseStore(RedisStoreConfig(server.url, password=PASSWORD, **config))


def test_redis_round_trip_ttl_and_prefix(redis_server: RedisServer) -> None:
    async def main() -> None:
        one, two = redis_store(redis_server, prefix="t1:", ttl_s=3600), redis_store(redis_server, prefix="t1:")
        kept = entry("resp_r1", "héllo 🙂", "session-9")
        await one.put(kept)
        assert await two.get("resp_r1") == kept  # another client (another router) reads it
        assert await two.get("resp_unknown") is None
        await one.put(entry("resp_r2"))
        await two.delete("resp_r2")  # ... and forgets it for every client
        assert await one.get("resp_r2") is None
        await one.close()
        await two.close()

    run(main())
    client = redis.Redis.from_url(redis_server.url, password=PASSWORD)
    assert 3500 < client.ttl("t1:resp_r1") <= 3600
    client.set("t1:resp_bad", b"not json")
    assert run(_get(redis_store(redis_server, prefix="t1:"), "resp_bad")) is None  # malformed: unknown
    client.close()


async def _get(store: RedisResponseStore, response_id: str) -> StoredResponse | None:
    try:
        return await store.get(response_id)
    finally:
        await store.close()


def test_redis_valkey_url_and_a_password_in_the_url(redis_server: RedisServer) -> None:
    url = f"valkey://:{PASSWORD}@127.0.0.1:{redis_server.port}/0"
    store = RedisResponseStore(RedisStoreConfig(url, password="a wrong one the URL overrides"))

    async def main() -> None:
        await store.put(entry("resp_v"))
        assert (await store.get("resp_v")).id == "resp_v"
        await store.close()

    run(main())
    assert "127.0.0.1" in store.describe()


def test_redis_wrong_password_and_a_dead_server_raise_store_errors(redis_server: RedisServer) -> None:
    wrong = RedisResponseStore(RedisStoreConfig(redis_server.url, password="wrong"))
    with pytest.raises(ResponseStoreError):
        run(_get(wrong, "resp_1"))
    dead = RedisResponseStore(RedisStoreConfig(f"redis://127.0.0.1:{free_port()}", connect_timeout_s=0.5))

    async def put_dead() -> None:
        try:
            await dead.put(entry("resp_1"))
        finally:
            await dead.close()

    with pytest.raises(ResponseStoreError):
        run(put_dead())
    with pytest.raises(ResponseStoreError):
        run(_get(RedisResponseStore(RedisStoreConfig(f"redis://127.0.0.1:{free_port()}")), "resp_1"))
