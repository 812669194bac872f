"""A real redis-server for the KV tiers' tests, on a free port, stopped afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tandem.launch.redis_server import RedisServer, find_redis_server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    if find_redis_server() is None:
        pytest.fail("redis-server is not installed: run scripts/setup.sh (it installs it)")
    with RedisServer(maxmemory_bytes=512 << 20) as server:
        yield server
