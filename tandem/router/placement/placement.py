"""Placement: the glue between a request, the routing policies and their metrics.

`prepare` gathers what the policies need before the first hop: the affinity key, and, for
kv_aware, the prompt's exact tokens from a worker's /tokenize (skipped when it cannot pay:
a key already decides, no worker has any cached block yet, or the prompt is shorter than a
block). `choose` asks the policy for a hop's worker and records the decision. `ended` is told
when a request is over on a worker, so its load is re-read before the next placement.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem.router.config import PolicyConfig, ScoringConfig
from tandem.router.placement.kv_index import KvIndex
from tandem.router.placement.policies import HopName, Placer, PromptRoute, affinity_key
from tandem.router.placement.tokenize import RemoteTokenizer, token_id_prompt, tokenize_body
from tandem.router.workers.registry import WorkerEndpoint, WorkerRegistry

logger = logging.getLogger(__name__)

_TOKENIZE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_DEFAULT_BLOCK_SIZE = 16


class PlacementMetrics:
    """Policy decisions, predicted prefix hits, the tokenize hop and KV index resyncs."""

    def __init__(
        self, registry: CollectorRegistry, index: KvIndex, workers: WorkerRegistry
    ) -> None:
        r = registry
        self.decisions = Counter(
            "tandem_router_policy_decisions",
            "hop placements by configured policy and by the rule that decided "
            "(session when an affinity key was present, least_tokens on a kv_aware fallback)",
            ["policy", "rule", "hop"],
            registry=r,
        )
        self.session_overflows = Counter(
            "tandem_router_session_overflows",
            "session placements that passed over the key's owner because it was at the load bound",
            registry=r,
        )
        self.predicted_hit_blocks = Counter(
            "tandem_router_kv_predicted_hit_blocks",
            "prompt blocks the chosen worker was predicted to have without computing them "
            "(kv_aware), by the medium each would come from (device, cpu, disk, cluster)",
            ["worker", "medium"],
            registry=r,
        )
        self.prompt_blocks = Counter(
            "tandem_router_kv_prompt_blocks",
            "full prompt blocks of kv_aware placements (the denominator of the hit ratio)",
            ["worker"],
            registry=r,
        )
        self.tokenize = Histogram(
            "tandem_router_tokenize_seconds",
            "the tokenize hop (POST /tokenize on a worker) for kv_aware routing",
            buckets=_TOKENIZE_BUCKETS,
            registry=r,
        )
        self.tokenize_failures = Counter(
            "tandem_router_tokenize_failures",
            "tokenize hops that failed or timed out (the request was routed by load)",
            registry=r,
        )
        self.resyncs = Counter(
            "tandem_router_kv_resyncs",
            "KV index snapshots taken per worker, by cause (start, gap, restart, error)",
            ["worker", "reason"],
            registry=r,
        )
        r.register(_CachedBlocksCollector(index, workers))


class _CachedBlocksCollector(Collector):
    def __init__(self, index: KvIndex, workers: WorkerRegistry) -> None:
        self._index = index
        self._workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily(
            "tandem_router_worker_kv_cached_blocks",
            "KV blocks the router's index says the worker holds on its device",
            labels=["worker"],
        )
        tiers = GaugeMetricFamily(
            "tandem_router_worker_kv_tier_blocks",
            "KV blocks the router's index says the worker holds in a lower tier of its own",
            labels=["worker", "medium"],
        )
        for worker in self._workers.workers:
            gauge.add_metric([worker.url], self._index.cached_blocks(worker.url))
            for medium, count in self._index.tier_blocks(worker.url).items():
                if medium != "device":
                    tiers.add_metric([worker.url, medium], count)
        yield gauge
        yield tiers
        yield GaugeMetricFamily(
            "tandem_router_kv_cluster_blocks",
            "KV blocks the router believes are in the cluster store (the union of the workers' "
            "reports; it may be stale)",
            value=self._index.cluster_blocks(),
        )


class Placement:
    def __init__(
        self,
        config: PolicyConfig,
        scoring: ScoringConfig,
        registry: WorkerRegistry,
        index: KvIndex,
        tokenizer: RemoteTokenizer,
        metrics: PlacementMetrics,
        refresh_load: Callable[[WorkerEndpoint], None] = lambda worker: None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.index = index
        self.placer = Placer(config, scoring, index)
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._tokenize_turns = itertools.count()
        self._refresh_load = refresh_load

    async def prepare(
        self,
        body: dict[str, Any],
        kind: str,
        headers: Mapping[str, str],
        passed_headers: dict[str, str],
        estimate: int,
        agent_session: str | None = None,
    ) -> PromptRoute:
        salt = body.get("cache_salt")
        key = affinity_key(headers, body, self.config.affinity_header, agent_session)
        route = PromptRoute(estimate, key,
                            cache_salt=salt if isinstance(salt, str) and salt else None)
        if route.affinity_key is not None or self.config.name != "kv_aware":
            return route
        ids = token_id_prompt(body, kind)
        if ids is not None:
            route.token_ids, route.prompt_tokens = ids, len(ids)
            return route
        if estimate < self._smallest_block() or not self._anything_cached():
            return route
        request = tokenize_body(body, kind)
        worker = self._tokenize_worker()
        if request is None or worker is None:
            return route
        started = time.monotonic()
        tokens = await self.tokenizer.tokens(worker, request, passed_headers)
        self.metrics.tokenize.observe(time.monotonic() - started)
        if tokens is None:
            self.metrics.tokenize_failures.inc()
            return route
        route.token_ids, route.prompt_tokens = tokens, len(tokens)
        return route

    def choose(
        self, pool: Sequence[WorkerEndpoint], route: PromptRoute, hop: HopName
    ) -> WorkerEndpoint | None:
        choice = self.placer.choose(pool, route, hop)
        if choice is None:
            return None
        worker = choice.worker
        self.registry.mark_picked(worker)
        self.metrics.decisions.labels(self.config.name, choice.rule, hop).inc()
        if choice.overflow:
            self.metrics.session_overflows.inc()
        if choice.rule == "kv_aware":
            for medium, count in choice.cached_by_tier.items():
                self.metrics.predicted_hit_blocks.labels(worker.url, medium).inc(count)
            self.metrics.prompt_blocks.labels(worker.url).inc(choice.prompt_blocks)
        note = f"{hop}:{choice.rule}"
        if choice.rule == "kv_aware":
            note += f"({choice.cached_blocks}/{choice.prompt_blocks}"  # cached / prompt blocks
            # blocks from lower tiers, when any: "cpu:40 cluster:16" (the rest on the device)
            note += "".join(
                f" {medium}:{count}"
                for medium, count in choice.cached_by_tier.items()
                if medium != "device"
            )
            if choice.best_credited_blocks > choice.credited_blocks:
                # passed over a better hit: how long it was, and why it lost
                note += f", best {choice.best_cached_blocks}: {choice.best_skipped}"
            note += ")"
        if choice.overflow:
            note += f"(+{choice.overflow})"  # ring owners passed over at the load bound
        route.notes.append(note)
        return worker

    def ended(self, *workers: WorkerEndpoint | None) -> None:
        """A request is over on these workers: their last polled load still counts it."""
        for worker in {w for w in workers if w is not None}:
            self._refresh_load(worker)

    def _tokenize_worker(self) -> WorkerEndpoint | None:
        pool = [w for w in self.registry.workers if w.healthy]
        if not pool:
            return None
        return pool[next(self._tokenize_turns) % len(pool)]

    def _anything_cached(self) -> bool:
        """Any block in any tier: a prompt only in a worker's CPU tier or the cluster store
        is still worth tokenizing for."""
        return self.index.cluster_blocks() > 0 or any(
            any(self.index.tier_blocks(w.url).values()) for w in self.registry.workers
        )

    def _smallest_block(self) -> int:
        sizes = [self.index.block_size(w.url) for w in self.registry.workers]
        return min((s for s in sizes if s), default=_DEFAULT_BLOCK_SIZE)
