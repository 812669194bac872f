"""What the router records when a call ends, once, however it ends.

A call ends in the proxy (an error before any byte), in a stream's generator (its last
event, or the client leaving mid-stream), or in a stream's response when the client left
before the generator ran. Each of them calls `finish`, and only the first counts: the
metrics, the usage ledger row, the caller's quota settled against the real usage, the
admission slot given back, placement's load on the workers, and the log line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from tandem.router.accounting.accounting import Accounting
from tandem.router.http.call import Call
from tandem.router.http.metrics import RouterMetrics
from tandem.router.http.upstream import Hop
from tandem.router.placement.placement import Placement
from tandem.router.resilience.admission import AdmissionQueue

# The request log line keeps the name it had when the proxy wrote it.
logger = logging.getLogger("tandem.router.http.proxy")


class Bookkeeping:
    def __init__(
        self,
        metrics: RouterMetrics,
        accounting: Accounting,
        admission: AdmissionQueue,
        placement: Placement,
    ) -> None:
        self.metrics = metrics
        self.accounting = accounting
        self.admission = admission
        self.placement = placement

    def cleanup(self, call: Call, hop: Hop | None = None) -> Callable[[], Awaitable[None]]:
        """What a stream must do even if its body never ran (the client left first)."""

        async def cleanup() -> None:
            if hop is not None:
                await hop.close()
            if not call.finished:
                call.status = 499
                self.finish(call)

        return cleanup

    def finish(self, call: Call) -> None:
        if call.finished:
            return
        call.finished = True
        end = time.monotonic()
        route = call.route
        self.metrics.requests.labels(route, call.protocol, str(call.status)).inc()
        self.metrics.e2e.labels(route).observe(end - call.received)
        if call.ttft is not None and call.first_output_worker is not None:
            self.metrics.ttft.labels(route, call.first_output_worker.url).observe(call.ttft)
        completion = (call.usage or {}).get("completion_tokens")
        if call.stream and call.ttft is not None and isinstance(completion, int) and completion > 1:
            self.metrics.tpot.labels(route).observe((end - call.received - call.ttft) / (completion - 1))
        self.metrics.observe_usage(
            call.prefill_worker or call.decode_worker,
            call.decode_worker or call.prefill_worker,
            call.usage,
        )
        self.accounting.record(call, end)
        if call.key is not None:
            self.accounting.settle(call.key, call.admitted_tokens, call.usage)
        if call.admitted:
            self.admission.leave()
        self.placement.ended(call.prefill_worker, call.decode_worker)
        prompt = call.usage.get("prompt_tokens") if call.usage else None
        counted = f"{prompt}" if prompt is not None else f"~{call.prompt_tokens}"
        logger.info(
            "%s %s route=%s (%s) prefill=%s decode=%s prompt_tokens=%s ttft=%s e2e=%.3fs "
            "retries=%d migrations=%d status=%d placement=%s",
            call.kind,
            "stream" if call.stream else "whole",
            route,
            call.reason,
            call.prefill_worker.url if call.prefill_worker else "-",
            call.decode_worker.url if call.decode_worker else "-",
            counted,
            f"{call.ttft:.3f}s" if call.ttft is not None else "-",
            end - call.received,
            call.retries,
            call.record.migrations if call.record is not None else 0,
            call.status,
            ",".join(call.prompt_route.notes) or "-",
        )
