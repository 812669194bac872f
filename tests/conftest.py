"""Session fixtures: one live `tandem serve` on the default model (see support/live_server.py).

Triton's kernels run on the CPU here, in its interpreter, and Triton reads TRITON_INTERPRET
when it is first imported, which transformers and torch may do while any test module is
collected: so it is set here, before every test module, not only in tests/kernels/gpu.

TANDEM_DEFAULT_MODE=exact: `auto` means the token-identical fp32 path in every engine and
server the tests start (most hold greedy tokens equal to transformers', and CI's CPU decides
what the fast default would be). The default mode itself is tested with the variable unset
(tests/platform/test_cpu_modes.py, tests/engine/test_default_mode.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tandem.launch.redis_server import find_redis_server
from tests.support.live_server import LiveServer, start_server, stop_server

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TANDEM_DEFAULT_MODE", "exact")


@pytest.fixture(scope="session")
def tandem_server_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """`tandem serve` on the default model with a small KV budget, shared by the session."""
    log_path = tmp_path_factory.mktemp("server") / "tandem-serve.log"
    # --max-tokens-policy reject: the error cases check vLLM's 400 for a max_tokens past the
    # context (the default, cap, has its own server in tests/server/test_max_tokens_policy.py).
    # --block-size 16: its tests count the cached tokens of short prompts in blocks of 16 (a CPU's
    # default is 64; tests/launch's clusters run it).
    server = start_server(log_path, "--kv-cache-memory", "256MiB", "--max-num-seqs", "16",
                          "--max-tokens-policy", "reject", "--block-size", "16")
    yield server
    left = stop_server(server)
    assert not left, f"processes left after SIGINT: {left}"
    assert server.process.returncode == 0, server.log()[-3000:]


@pytest.fixture(scope="session")
def tandem_server(tandem_server_process: LiveServer) -> str:
    """Base URL (http://127.0.0.1:PORT) of the session's live `tandem serve`."""
    return tandem_server_process.url


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """A redis-server (or valkey-server) binary, for tests that start servers of their own.

    Fails (does not skip) when none is installed: scripts/setup.sh installs it, and a silently
    skipped store test hides a broken tier."""
    binary = find_redis_server()
    if binary is None:
        pytest.fail("no redis-server or valkey-server found: run scripts/setup.sh "
                    "(it installs redis-server) or `apt-get install redis-server`")
    return binary
