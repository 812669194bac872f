"""The router's Prometheus metrics, in a registry of its own (no process-global default).

Per worker: hop outcomes, prompt and generated tokens, health and in-flight requests. Per
route (pd / direct): time to first token (also per worker) and end-to-end latency. For
disaggregation: the prefill hop's duration and the time from sending the decode hop to its
first output (KV transfer plus one decode step), fallbacks, and retries. Router overhead is
the time from receiving a request to sending its first hop (parsing, counting tokens, scoring).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem.router.resilience.breaker import STATE_CODES
from tandem.router.workers.registry import WorkerEndpoint

_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class _WorkerCollector(Collector):
    """Reads the live worker list at scrape time, so removed workers simply disappear."""

    def __init__(self, workers: Callable[[], tuple[WorkerEndpoint, ...]]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily(
            "tandem_router_worker_healthy", "1 when the worker is up", labels=["worker", "role"]
        )
        in_flight = GaugeMetricFamily(
            "tandem_router_worker_in_flight",
            "requests this router has open on the worker",
            labels=["worker"],
        )
        queued = GaugeMetricFamily(
            "tandem_router_worker_waiting_prefill_tokens",
            "prompt tokens waiting on the worker at the last poll",
            labels=["worker"],
        )
        kv = GaugeMetricFamily(
            "tandem_router_worker_kv_usage",
            "KV cache fraction in use at the last poll",
            labels=["worker"],
        )
        breaker = GaugeMetricFamily(
            "tandem_router_worker_breaker_state",
            "the worker's circuit breaker: 0 closed, 1 open, 2 half-open",
            labels=["worker"],
        )
        trips = CounterMetricFamily(
            "tandem_router_worker_breaker_trips",
            "times the worker's circuit breaker opened",
            labels=["worker"],
        )
        for worker in self._workers():
            healthy.add_metric([worker.url, worker.role], 1.0 if worker.healthy else 0.0)
            breaker.add_metric([worker.url], STATE_CODES[worker.breaker.state])
            trips.add_metric([worker.url], worker.breaker.trips)
            in_flight.add_metric([worker.url], worker.in_flight)
            if worker.load is not None:
                queued.add_metric([worker.url], worker.load.waiting_prefill_tokens)
                kv.add_metric([worker.url], float(worker.load.raw.get("kv_usage") or 0.0))
        yield from (healthy, in_flight, queued, kv, breaker, trips)


class RouterMetrics:
    def __init__(self, workers: Callable[[], tuple[WorkerEndpoint, ...]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "tandem_router_requests",
            "client requests by route and status",
            ["route", "endpoint", "status"],
            registry=r,
        )
        self.hops = Counter(
            "tandem_router_worker_requests",
            "hops sent to a worker, by outcome",
            ["worker", "hop", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tandem_router_prompt_tokens",
            "prompt tokens served, per worker",
            ["worker"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "tandem_router_cached_prompt_tokens",
            "prompt tokens served from the worker's prefix cache",
            ["worker"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "tandem_router_generation_tokens",
            "completion tokens generated, per worker",
            ["worker"],
            registry=r,
        )
        self.migrations = Counter(
            "tandem_router_migrations",
            "streams moved to another worker after theirs failed mid-response",
            ["route"],
            registry=r,
        )
        self.retries = Counter(
            "tandem_router_retries", "hops retried on another worker", ["hop"], registry=r
        )
        self.queue_wait = Histogram(
            "tandem_router_queue_wait_seconds",
            "time requests waited in the router's admission queue (those that waited)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries_denied = Counter(
            "tandem_router_retries_denied",
            "retries not made because the retry budget was spent (the failure went to the client)",
            ["hop"],
            registry=r,
        )
        self.ledger_rows = Counter(
            "tandem_router_ledger_rows",
            "usage ledger rows by outcome (written, or failed after retries: lost)",
            ["outcome"],
            registry=r,
        )
        self.fallbacks = Counter(
            "tandem_router_pd_fallbacks",
            "PD requests served whole by one worker after the prefill hop failed",
            registry=r,
        )
        self.ttft = Histogram(
            "tandem_router_time_to_first_token_seconds",
            "request received to first output sent to the client, by the worker that produced it",
            ["route", "worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem_router_e2e_request_latency_seconds",
            "request received to done",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "tandem_router_time_per_output_token_seconds",
            "a request's first output to done, over its output tokens after the first (vLLM's TPOT)",
            ["route"],
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.prefill_hop = Histogram(
            "tandem_router_pd_prefill_hop_seconds",
            "prefill hop: sent to reply read",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_first = Histogram(
            "tandem_router_pd_decode_first_output_seconds",
            "decode hop: sent to its first output (KV transfer + a step)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "tandem_router_overhead_seconds",
            "request received to first hop sent",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        r.register(_WorkerCollector(workers))

    def observe_usage(
        self,
        prompt_worker: WorkerEndpoint | None,
        decode_worker: WorkerEndpoint | None,
        usage: dict | None,
    ) -> None:
        if not usage:
            return
        if prompt_worker is not None:
            self.prompt_tokens.labels(prompt_worker.url).inc(int(usage.get("prompt_tokens") or 0))
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            self.cached_tokens.labels(prompt_worker.url).inc(int(cached))
        if decode_worker is not None:
            self.generation_tokens.labels(decode_worker.url).inc(
                int(usage.get("completion_tokens") or 0)
            )

    def render(self) -> bytes:
        return generate_latest(self.registry)
