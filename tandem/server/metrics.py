"""Prometheus metrics with vLLM's names under a `tandem:` prefix.

Dashboards built for vLLM (`vllm:num_requests_running`, `vllm:time_to_first_token_seconds`,
...) carry over by swapping the prefix. Engine state (queue lengths, KV usage, prefix-cache
counters) is read from the engine's latest load report at scrape time, so it is never
stale; per-request figures are observed when a request ends. Each server owns its own
registry: two servers in one process (tests) never mix their numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tandem.server.generate import RequestTimings
from tandem.types import EngineLoad

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0)
_LATENCY_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0)


class _EngineStateCollector(Collector):
    def __init__(self, model_name: str, load: Callable[[], EngineLoad], in_flight: Callable[[], int]) -> None:
        self.model_name = model_name
        self.load = load
        self.in_flight = in_flight

    def collect(self) -> Iterable[Metric]:
        load = self.load()
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            metric = GaugeMetricFamily(f"tandem:{name}", doc, labels=labels)
            metric.add_metric(values, value)
            return metric

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            metric = CounterMetricFamily(f"tandem:{name}", doc, labels=labels)
            metric.add_metric(values, value)
            return metric

        yield gauge("num_requests_running", "Sequences in the running batch.", load.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", load.num_waiting)
        yield gauge("num_requests_in_flight", "Requests the API server is serving.", self.in_flight())
        yield gauge("num_waiting_prefill_tokens", "Prompt tokens not yet computed.", load.waiting_prefill_tokens)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", load.kv_usage)
        yield gauge("kv_cache_blocks_total", "KV blocks in the pool.", load.kv_blocks_total)
        yield gauge("kv_blocks_retained", "Cached KV blocks a cache breakpoint keeps ahead of others (its TTL).",
                    load.kv_blocks_retained)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      load.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", load.prefix_cache_hits)
        yield counter("connector_loaded_tokens", "Prompt tokens whose KV a connector loaded (PD handoff, KV tiers).",
                      load.connector_loaded_tokens)
        yield counter("num_preemptions", "Sequences preempted for lack of KV blocks.", load.num_preemptions)
        transfer = load.connector("kv_transfer")
        yield gauge("kv_transfer_held", "Prompt KV handoffs kept for a decode worker.", transfer.get("held", 0))
        yield counter("kv_transfer_blocks_sent", "KV blocks served to decode workers.",
                      transfer.get("blocks_sent", 0))
        yield counter("kv_transfer_blocks_received", "KV blocks fetched from prefill workers.",
                      transfer.get("blocks_received", 0))
        yield counter("kv_transfer_bytes_sent", "KV bytes served to decode workers over tcp (after the codec).",
                      transfer.get("bytes_sent", 0))
        yield counter("kv_transfer_bytes_received", "KV bytes fetched from prefill workers (tcp or shared memory).",
                      transfer.get("bytes_received", 0))
        yield counter("kv_transfer_pull_failures", "Handoffs whose fetch failed (prompt recomputed).",
                      transfer.get("pull_failures", 0))
        yield counter("kv_transfer_pull_seconds", "Time spent fetching KV from prefill workers.",
                      transfer.get("pull_seconds", 0.0))
        if tiers := load.connector("kv_tiers"):
            yield from _tier_metrics(self.model_name, tiers)
        if load.spec_decode:
            yield from _spec_decode_metrics(self.model_name, load.spec_decode)
        if load.structured:
            yield from _structured_metrics(self.model_name, load.structured)


# Structured outputs' counters (tandem/structured/constraints.py), as `tandem:structured_<name>`.
_STRUCTURED_COUNTERS = {
    "requests": "Sequences generated under a grammar (a schema, regex, choice or tool-call grammar).",
    "compile_errors": "Grammars that failed to compile in the engine.",
    "compile_seconds": "Time spent compiling grammars (off the engine loop).",
    "mask_rows": "Token masks computed (one per constrained token sampled).",
    "mask_seconds": "Time spent computing token masks (overlapped with the forward).",
    "forced_tokens": "Tokens appended by jump-forward, without sampling.",
    "drafts_rejected": "Draft tokens dropped before verification because the grammar forbade them.",
}


def _structured_metrics(model_name: str, stats: dict[str, Any]) -> Iterable[Metric]:
    for name, doc in _STRUCTURED_COUNTERS.items():
        metric = CounterMetricFamily(f"tandem:structured_{name}", doc, labels=["model_name"])
        metric.add_metric([model_name], stats.get(name, 0))
        yield metric


def _spec_decode_metrics(model_name: str, spec: dict[str, Any]) -> Iterable[Metric]:
    """vLLM's speculative decoding counters (`vllm:spec_decode_*`) under `tandem:`."""
    for name, doc in (("num_drafts", "Verifications that checked at least one draft token."),
                      ("num_draft_tokens", "Draft tokens verified."),
                      ("num_accepted_tokens", "Draft tokens the target accepted.")):
        metric = CounterMetricFamily(f"tandem:spec_decode_{name}", doc, labels=["model_name"])
        metric.add_metric([model_name], spec.get(name, 0))
        yield metric
    per_position = CounterMetricFamily("tandem:spec_decode_num_accepted_tokens_per_pos",
                                       "Draft tokens accepted, by position in the draft.",
                                       labels=["model_name", "position"])
    for position, count in enumerate(spec.get("accepted_per_position", [])):
        per_position.add_metric([model_name, str(position)], count)
    yield per_position
    length = GaugeMetricFamily("tandem:spec_decode_mean_acceptance_length",
                               "Tokens per verification, the target's own included (1 + accepted / drafts).",
                               labels=["model_name"])
    length.add_metric([model_name], spec.get("mean_acceptance_length", 0.0))
    yield length


# Per-tier counters the KV tiers report (connector/tiers.py), as `tandem:kv_tier_<name>{medium}`.
_TIER_COUNTERS = {
    "chunk_hits": "Chunks found in the tier and loaded.",
    "chunks_loaded": "Chunks read from the tier into the KV cache.",
    "misses": "Chunks a load expected in the tier but did not find (recomputed).",
    "corrupt": "Chunks the tier returned that failed their checks (recomputed, deleted).",
    "bytes_in": "Bytes written into the tier.",
    "bytes_out": "Bytes loaded from the tier into the KV cache.",
    "evictions": "Chunks the tier evicted for its budget.",
    "write_errors": "Writes into the tier that failed.",
    "errors": "Operations on the tier's store that failed.",
}


def tier_blocks(load: EngineLoad) -> dict[str, dict[str, Any]]:
    """Blocks per tier for /load: the device pool's, then each KV tier's that this worker runs."""
    tiers: dict[str, dict[str, Any]] = {
        "device": {"blocks_used": load.kv_blocks_used, "blocks_total": load.kv_blocks_total,
                   "blocks_cached": load.kv_blocks_cached, "blocks_retained": load.kv_blocks_retained}}
    for medium, stats in load.connector("kv_tiers").get("media", {}).items():
        entry = {"blocks": int(stats.get("blocks", 0))}
        if "budget_bytes" in stats:
            entry["budget_bytes"] = int(stats["budget_bytes"])
        if "bytes_used" in stats or "bytes" in stats:
            entry["bytes"] = int(stats.get("bytes", stats.get("bytes_used", 0)))
        tiers[medium] = entry
    return tiers


def _tier_metrics(model_name: str, tiers: dict[str, Any]) -> Iterable[Metric]:
    labels = ["model_name", "medium"]
    media = tiers.get("media", {})
    blocks = GaugeMetricFamily("tandem:kv_tier_blocks", "KV blocks held in each tier below the device pool.",
                               labels=labels)
    for medium, stats in media.items():
        blocks.add_metric([model_name, medium], stats.get("blocks", 0))
    yield blocks
    per_token = GaugeMetricFamily("tandem:kv_tier_bytes_per_token",
                                  "Bytes one token's KV takes in every tier, after --kv-tier-dtype's codec.",
                                  labels=["model_name", "codec"])
    per_token.add_metric([model_name, str(tiers.get("codec", "raw"))], tiers.get("bytes_per_token", 0.0))
    yield per_token
    for name, doc in _TIER_COUNTERS.items():
        metric = CounterMetricFamily(f"tandem:kv_tier_{name}", doc, labels=labels)
        for medium, stats in media.items():
            metric.add_metric([model_name, medium], stats.get(name, 0))
        yield metric
    plain = [("loads", "Requests whose prompt KV was loaded from a tier."),
             ("loads_failed", "Tier loads that failed (prompt recomputed)."),
             ("loads_timed_out", "Tier loads given up on (prompt recomputed)."),
             ("loads_skipped_by_cost", "Tier hits not loaded: recomputing was estimated faster."),
             ("probe_errors", "Existence probes of a slow tier that failed (counted as misses).")]
    for name, doc in plain:
        metric = CounterMetricFamily(f"tandem:kv_tier_{name}", doc, labels=["model_name"])
        metric.add_metric([model_name], tiers.get(name, 0))
        yield metric
    writer = tiers.get("writer", {})
    depth = GaugeMetricFamily("tandem:kv_tier_writer_queue_depth", "Chunks waiting for the slow-tier writer.",
                              labels=["model_name"])
    depth.add_metric([model_name], writer.get("queue_depth", 0))
    yield depth
    dropped = CounterMetricFamily("tandem:kv_tier_writes_dropped",
                                  "Slow-tier writes dropped because the writer's queue was full.",
                                  labels=["model_name"])
    dropped.add_metric([model_name], writer.get("dropped", 0))
    yield dropped
    bounds = tiers.get("load_seconds_bounds", [])
    histogram = HistogramMetricFamily("tandem:kv_tier_load_seconds",
                                      "Seconds a request waited for its KV from a tier (the slowest it read).",
                                      labels=labels)
    for medium, hist in tiers.get("load_seconds", {}).items():
        cumulative, buckets = 0, []
        for bound, count in zip([*bounds, float("inf")], hist["buckets"], strict=True):
            cumulative += count
            buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
        histogram.add_metric([model_name, medium], buckets, hist["sum"])
    yield histogram


class ServerMetrics:
    def __init__(self, model_name: str, load: Callable[[], EngineLoad], in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineStateCollector(model_name, load, in_flight))
        labels = ["model_name"]
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens of finished requests.",
                                     labels, registry=self.registry)
        self.generation_tokens = Counter("tandem:generation_tokens", "Generated tokens.",
                                         labels, registry=self.registry)
        self.cached_tokens = Counter("tandem:prompt_tokens_cached", "Prompt tokens served from the prefix cache.",
                                     labels, registry=self.registry)
        self.request_success = Counter("tandem:request_success", "Finished requests by finish reason.",
                                       [*labels, "finished_reason"], registry=self.registry)
        self.request_errors = Counter("tandem:request_errors", "Requests refused or failed, by HTTP status.",
                                      [*labels, "status"], registry=self.registry)
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Time between output tokens.",
                             labels, buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Arrival to last token.",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queue_time = Histogram("tandem:request_queue_time_seconds", "Time waiting before first scheduled.",
                                    labels, buckets=_LATENCY_BUCKETS, registry=self.registry)

    def observe_finished(self, timings: RequestTimings, end: float, prompt_tokens: int, cached_tokens: int,
                         generation_tokens: int, finish_reasons: list[str]) -> None:
        name = self.model_name
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.cached_tokens.labels(name).inc(cached_tokens)
        self.generation_tokens.labels(name).inc(generation_tokens)
        for reason in finish_reasons:
            self.request_success.labels(name, reason).inc()
        if timings.first_token is not None:
            self.ttft.labels(name).observe(timings.first_token - timings.arrival)
        itl = self.itl.labels(name)
        for gap in timings.inter_token:
            itl.observe(gap)
        self.e2e.labels(name).observe(end - timings.arrival)
        if timings.queue_seconds is not None:
            self.queue_time.labels(name).observe(timings.queue_seconds)

    def observe_error(self, status: int) -> None:
        self.request_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
