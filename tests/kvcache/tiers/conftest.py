"""The store tests' server binary. The session's `redis_server` fixture (a real server on a
free port) is tests/kvcache/conftest.py's; tests here that start servers of their own ask
for `redis_binary`, which fails (it does not skip) when none is installed: scripts/setup.sh
installs it, and a silently skipped store test hides a broken tier."""

from __future__ import annotations

import pytest

from tandem.kvcache.tiers.redis_server import find_redis_server


@pytest.fixture(scope="session")
def redis_binary() -> str:
    binary = find_redis_server()
    if binary is None:
        pytest.fail("no redis-server or valkey-server found: run scripts/setup.sh "
                    "(it installs redis-server) or `apt-get install redis-server`")
    return binary
