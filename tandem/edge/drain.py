"""Graceful drain on SIGTERM, for the worker's and the router's uvicorn servers.

uvicorn on SIGTERM closes its listening socket at once and gives open requests a few seconds:
a load balancer still sending there sees connection errors, and a long stream is cut. A
draining server instead keeps its socket open and answers every new request with a
retryable 503 (`code: draining`, `Retry-After`), which tandem's router takes as "try another
worker" (no breaker, no error to the client); its /health turns 503 so that pollers stop
sending; the requests it has keep running until they end or `--shutdown-timeout` passes;
then uvicorn's normal shutdown runs. A second SIGTERM, or SIGINT (Ctrl-C), stops it now.

Kubernetes sends SIGTERM and waits `terminationGracePeriodSeconds`; `tandem up` stops its
children with SIGINT (fast). Imports uvicorn only: the router must not import the engine.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from tandem.edge.errors import APIError

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


class Drain:
    """Whether a server is draining, and when it is done (nothing left, or out of time)."""

    def __init__(self, timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.started_at: float | None = None
        self.busy: Callable[[], int] = lambda: 0  # the server sets what it waits for

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def start(self) -> None:
        """Signal-safe: only sets a time; the server's tick does the rest."""
        if self.started_at is None:
            self.started_at = time.monotonic()

    def done(self) -> bool:
        if self.started_at is None:
            return False
        return self.busy() == 0 or time.monotonic() - self.started_at >= self.timeout_s

    def refusal(self, what: str = "this server") -> APIError:
        return APIError(503, f"{what} is shutting down; send the request elsewhere", None,
                        "draining", headers={"Retry-After": "1"})


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM drains instead of stopping."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._announced = False

    def serve_until_stopped(self) -> None:
        """`run`, as `uvicorn.run` does it: a Ctrl-C that stopped it is not an error."""
        with contextlib.suppress(KeyboardInterrupt):
            self.run()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.drain.draining and not self.should_exit:
            self._captured_signals.append(sig)
            self.drain.start()
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.draining and not self.should_exit:
            if not self._announced:
                self._announced = True
                logger.info("SIGTERM: draining; %d request(s) in flight, stopping when they end "
                            "or in %.0f s at most; new requests get 503 'draining'",
                            self.drain.busy(), self.drain.timeout_s)
            if self.drain.done():
                left = self.drain.busy()
                if left:
                    logger.warning("shutdown timeout: stopping with %d request(s) still in flight", left)
                else:
                    logger.info("drained: nothing in flight; stopping")
                self.should_exit = True
        return await super().on_tick(counter)
