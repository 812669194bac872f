"""Fixtures for router tests: fake workers and in-process routers on real ports."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tandem.router.config import HealthPolicy, RetryPolicy, RouterConfig, Timeouts, WorkerSpec
from tandem.router.http.app import build_app
from tests.support.live_server import TEST_SECRET
from tests.support.router_helpers import FakeWorker, ThreadServer

# Quick reactions, so fault tests take seconds. The hop limits are not quick: a fake worker's
# reply is milliseconds, but on a loaded CI box one took over a second, which a 1 s limit turned
# into a failed hop. A test of a limit (a hung worker) sets its own.
FAST_HEALTH = HealthPolicy(interval_s=0.1, timeout_s=1.0, failures_to_down=3, successes_to_up=2)
FAST_TIMEOUTS = Timeouts(connect_s=5.0, first_byte_s=10.0, idle_s=10.0)
FAST_RETRY = RetryPolicy(max_attempts=3, backoff_s=0.01)


@pytest.fixture
def fake_workers() -> Iterator[Callable[[str], tuple[FakeWorker, str]]]:
    """fake_workers(name) -> (worker, url); all stopped at teardown."""
    servers: list[ThreadServer] = []

    def start(name: str) -> tuple[FakeWorker, str]:
        worker = FakeWorker(name)
        server = ThreadServer(worker.app()).start()
        servers.append(server)
        return worker, server.url

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def start_router() -> Iterator[Callable[..., str]]:
    """start_router(workers=[WorkerSpec...], **RouterConfig fields) -> base URL."""
    servers: list[ThreadServer] = []

    def start(workers: list[WorkerSpec] | tuple[WorkerSpec, ...] = (), **fields: object) -> str:
        options: dict[str, object] = {
            "health": FAST_HEALTH,
            "timeouts": FAST_TIMEOUTS,
            "retry": FAST_RETRY,
            "pd_min_prompt_tokens": 0,
            # Splits and migration need the cluster secret (tandem/trust); fake workers ignore
            # the signatures, real ones started with the same secret check them.
            "cluster_secret": TEST_SECRET,
        }
        options.update(fields)
        config = RouterConfig(workers=tuple(workers), **options)  # type: ignore[arg-type]
        server = ThreadServer(build_app(config)).start()
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.stop()
