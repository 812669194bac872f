"""Routing policies: which worker of a pool serves a request's first hop (no I/O here).

An affinity key, when the request has one, decides first under every policy: the worker is
the key's owner on a consistent-hash ring over the pool's healthy workers, walking on past
any worker whose in-flight requests would exceed ⌈c × average⌉ (c = `--balance-factor`,
1.25). Keys come from `x-session-affinity`, then `--affinity-header`, then the body's `user`.

Without a key, `--policy`:

- `kv_aware` (default): the worker with the lowest cost, in tokens,

      cost = w × prefill_tokens + decode_tokens                            w = 4.0
      prefill_tokens  = waiting prefill tokens + unreflected prefill tokens
                        + max(0, prompt tokens − credited_blocks × B)
      decode_tokens   = running KV tokens + unreflected decode tokens
      credited_blocks = Σ credit(medium of block i), over the blocks i of the run

  where the run is the longest prefix of the prompt's block-hash chain (blocks of B tokens)
  that the worker can have without computing it, from the workers' KV events (kv_index.py):
  each block on its device, in its CPU-memory or disk tier, or in the cluster store, and
  taken from whichever of those holds it with the highest credit. With only a device pool
  credited_blocks is the device prefix hit, as before tiers. The decision (`Choice`) keeps
  the run's length as `cached_blocks` and its blocks per medium as `cached_by_tier`, for the
  log line and the predicted-hit metric. This is Dynamo's `w × uncached
  prefill blocks + decode blocks`, times B so that workers with different block sizes
  compare, and with the worker's queue counted in: a hit is worth the prefill it saves, and
  a worker whose queue outweighs its hit loses to an idle one. Queues count only tokens still
  to compute: workers report waiting requests net of the cached prefix they found on arrival,
  and the router counts what it has just sent by the uncached tokens it predicted for that
  worker (prompt − credited_blocks × B).
  Dynamo weighs the two terms equally (w = 1); here w = 4, because a prefill token costs a
  forward pass while a running sequence's KV token costs one attention read per decode step:
  with w = 1 an agent's turn, 90% cached on a worker that was decoding another long session,
  moved to an idle worker and recomputed thousands of tokens there. Once the pool is busy (on
  average a request in flight per worker), workers at the load bound are skipped as for
  sessions, so one hot prefix cannot pile every request onto one worker; below that the cost
  alone decides, because batching a request with one or two others costs far less than
  recomputing its prompt elsewhere. Without the prompt's tokens (the tokenize hop failed or
  timed out, or nothing is cached anywhere yet) it routes as `least_tokens`.

  **Tier credits** (`--kv-credit-cpu`, `--kv-credit-disk`, `--kv-credit-cluster`): a block in
  a lower tier must be loaded before it is used, so a hit there saves only part of its
  prefill; its credit is that fraction. By default each worker's credits are **measured**
  from its own /load report (`kv_tiers.cost_model`: the bandwidth its loads from each tier
  achieved and the prefill rate its steps achieved, both moving averages):

      credit(m) = clamp(1 − (block bytes / bandwidth(m)) / (block size / prefill tokens per s), 0, 1)

  so a tier that loads far faster than the model computes counts almost like the device, and
  one slower than recomputing counts nothing (the worker's own cost model would decline that
  load anyway). Measured on the 2-core AVX-512 EPYC with the default model (fp32, 4,096-token
  prefixes, `tandem bench kv-tiers`): the prefill costs about 30 ms per 16-token block, and
  a whole tier-served TTFT divided by its 256 blocks (an upper bound on a block's load) is
  0.6 ms from CPU memory, 0.8 ms from disk through the page cache, 1.3 ms from a cold disk
  and 1.1 ms from Redis on loopback: credits of 0.96-0.98 on that box. Until a worker has loaded from a tier the fallback stands in (device 1.0; cpu 0.75,
  disk 0.25, cluster 0.25: a GPU worker's forward pass is cheap next to a disk read); a
  number given on the command line fixes that tier's credit for every worker.

  Cluster residency is the pool's (any worker's writes, see kv_index.py), so it is credited
  to every worker that can read the store: one that has reported cluster blocks itself or
  whose /load lists a "cluster" medium under `kv_tiers` (a worker without the tier would
  only ever miss). When the prompt is only in the cluster store, those workers get the same
  credit and their loads decide. Approximations: the set may be stale (a miss recomputes),
  and workers load lower tiers in whole chunks of blocks, so a run that ends inside a chunk
  is credited a few blocks the worker will compute.
- `least_tokens`: the token scores of scoring.py (queued prefill tokens for prefill workers,
  KV fraction in use for decode / colocated workers).
- `session`: the ring for requests with a key, `least_tokens` for the rest.
- `round_robin`: in turn, ignoring load.

A decode hop (PD mode) is chosen by the ring over decode workers when the request has a key
(the decode worker keeps that session's KV too), else by the decode score.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.kvcache.block_hash import chain_hash, salted_root
from tandem.kvcache.events import MEDIA
from tandem.router.config import PolicyConfig, ScoringConfig
from tandem.router.placement.kv_index import CLUSTER, KvIndex
from tandem.router.placement.ring import HashRing, bounded_pick, load_bound
from tandem.router.placement.scoring import pick_decode, pick_lowest, pick_prefill
from tandem.router.workers.registry import LoadSnapshot, WorkerEndpoint

AFFINITY_HEADER = "x-session-affinity"
# A hop's name: "prefill" and "decode" (PD mode) or "direct" (a whole request on one worker).
HopName = str
_MAX_RINGS = 32  # rings cached per distinct healthy pool; pools change rarely


def affinity_key(
    headers: Mapping[str, str], body: Mapping[str, Any], extra_header: str | None,
    agent_session: str | None = None,
) -> str | None:
    """x-session-affinity, then the configured header, then the agent's own session id (read by
    its protocol's adapter, tandem/edge/protocols), then the OpenAI `user` field."""
    for name in (AFFINITY_HEADER, extra_header):
        if name:
            value = headers.get(name)
            if value:
                return value
    if agent_session:
        return agent_session
    user = body.get("user")
    return user if isinstance(user, str) and user else None


@dataclass
class PromptRoute:
    """What the policies know of one request; block hashes are computed lazily and kept."""

    prompt_tokens: int
    affinity_key: str | None = None
    token_ids: Sequence[int] | None = None
    notes: list[str] = field(default_factory=list)  # one per placement, for the log line
    # kv_aware: the prompt tokens each worker (by URL) would compute, after its credited
    # cached prefix (prompt − credited_blocks × B)
    uncached: dict[str, int] = field(default_factory=dict)
    cache_salt: str | None = None  # the request's: workers salt its chain, so the index must too
    _chains: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False)

    def block_hash(self, root: int, block_size: int, index: int) -> int | None:
        """Hash of full block `index` under (root, block_size); None past the last one."""
        tokens = self.token_ids
        if tokens is None or (index + 1) * block_size > len(tokens):
            return None
        chain = self._chains.setdefault((root, block_size), [])
        while len(chain) <= index:
            start = len(chain) * block_size
            parent = chain[-1] if chain else salted_root(root, self.cache_salt)
            chain.append(chain_hash(parent, tokens[start : start + block_size]))
        return chain[index]

    def prefill_work(self, url: str) -> int:
        """Tokens this prompt adds to the worker's prefill queue: what kv_aware predicted it
        would compute there, else the whole prompt."""
        return self.uncached.get(url, self.prompt_tokens)

    def full_blocks(self, block_size: int) -> int:
        return len(self.token_ids) // block_size if self.token_ids is not None else 0


@dataclass(frozen=True)
class Choice:
    """A placement and why it was made, for the metrics and the request's log line."""

    worker: WorkerEndpoint
    rule: str  # the rule that decided: session, kv_aware, least_tokens, round_robin
    # kv_aware: the predicted prefix hit on the chosen worker, in blocks from every tier
    cached_blocks: int = 0
    credited_blocks: float = 0.0  # kv_aware: that run weighed by tier credit
    cached_by_tier: dict[str, int] = field(default_factory=dict)  # kv_aware: medium → blocks
    prompt_blocks: int = 0
    # kv_aware: the run of the worker with the most credited blocks in the pool
    best_cached_blocks: int = 0
    best_credited_blocks: float = 0.0
    best_skipped: str = ""  # kv_aware: why that worker lost (over the load bound, or its cost)
    overflow: int = 0  # session: ring owners passed over because they were full


def ranked_media(credits: Mapping[str, float]) -> list[str]:
    """Media best first by credit (ties in MEDIA order), without those credited nothing."""
    return sorted((m for m in MEDIA if credits.get(m, 0.0) > 0), key=lambda m: -credits[m])


def measured_credits(raw: Mapping[str, Any], media: Sequence[str]) -> dict[str, float]:
    """A worker's credit per tier from its own figures (/load `kv_tiers`): 1 − seconds to load
    a block from the tier ÷ seconds to compute one, from the bandwidth its loads measured and
    the prefill rate its steps measured; only tiers it has loaded from."""
    tiers = raw.get("kv_tiers")
    if not isinstance(tiers, Mapping):
        return {}
    model = tiers.get("cost_model") or {}
    block_bytes, block_size = tiers.get("block_bytes"), raw.get("block_size")
    prefill_tps = model.get("prefill_tokens_per_s")
    if not (block_bytes and block_size and prefill_tps):
        return {}
    compute_s = block_size / prefill_tps
    out = {}
    for medium in media:
        bandwidth = model.get(f"{medium}_bytes_per_s")
        if bandwidth:
            out[medium] = min(1.0, max(0.0, 1.0 - (block_bytes / bandwidth) / compute_s))
    return out


def credited(run: Sequence[str], credits: Mapping[str, float]) -> float:
    """Σ credit(medium of block i) over a run from `KvIndex.tiered_prefix`."""
    return sum(credits[medium] for medium in run)


def kv_cost(
    worker: WorkerEndpoint,
    credited_blocks: float,
    prompt_tokens: int,
    block_size: int,
    weight: float,
) -> float:
    load = worker.load or LoadSnapshot()
    uncached = max(0.0, prompt_tokens - credited_blocks * block_size)
    prefill = load.waiting_prefill_tokens + worker.unreflected_tokens("prefill") + uncached
    decode = load.running_kv_tokens + worker.unreflected_tokens("decode")
    return weight * prefill + decode


class Placer:
    """Applies the policy; holds only caches (rings per pool) and the round-robin turn."""

    def __init__(self, config: PolicyConfig, scoring: ScoringConfig, index: KvIndex) -> None:
        self.config = config
        self.scoring = scoring
        self.index = index
        self._rings: dict[frozenset[str], HashRing] = {}
        self._turns = itertools.count()
        self._credits = config.tier_credits
        self._measured = config.measured_media

    def choose(
        self, pool: Sequence[WorkerEndpoint], route: PromptRoute, hop: HopName
    ) -> Choice | None:
        if not pool:
            return None
        if route.affinity_key is not None:
            return self.session(pool, route.affinity_key)
        if hop == "decode":
            return self._least_tokens(pool, route, hop)
        name = self.config.name
        if name == "round_robin":
            ordered = sorted(pool, key=lambda w: w.url)
            return Choice(ordered[next(self._turns) % len(ordered)], "round_robin")
        if name == "kv_aware" and route.token_ids is not None:
            return self.kv_aware(pool, route)
        return self._least_tokens(pool, route, hop)

    def session(self, pool: Sequence[WorkerEndpoint], key: str) -> Choice:
        by_url = {w.url: w for w in pool}
        members = frozenset(by_url)
        ring = self._rings.get(members)
        if ring is None:
            if len(self._rings) >= _MAX_RINGS:
                self._rings.clear()
            ring = self._rings[members] = HashRing(sorted(members), self.config.virtual_nodes)
        picked = bounded_pick(
            ring, key, lambda url: by_url[url].in_flight, self.config.balance_factor
        )
        assert picked is not None  # the pool is not empty
        url, position = picked
        return Choice(by_url[url], "session", overflow=position)

    def kv_aware(self, pool: Sequence[WorkerEndpoint], route: PromptRoute) -> Choice:
        candidates = list(pool)
        loads = [w.in_flight for w in pool]
        if sum(loads) >= len(loads):  # the pool is busy: guard against hot spots
            bound = load_bound(loads, self.config.balance_factor)
            candidates = [w for w in pool if w.in_flight + 1 <= bound] or candidates
        credits = {w: self.credits_for(w) for w in pool}
        runs = {
            w: self.index.tiered_prefix(
                w.url, route.block_hash, ranked_media(credits[w]), self.reads_cluster(w)
            )
            for w in pool
        }
        hits = {w: credited(runs[w], credits[w]) for w in pool}
        for worker in pool:
            uncached = route.prompt_tokens - hits[worker] * self._block_size(worker)
            route.uncached[worker.url] = max(0, round(uncached))
        costs: dict[WorkerEndpoint, float] = {}
        for worker in candidates:
            costs[worker] = kv_cost(
                worker, hits[worker], route.prompt_tokens, self._block_size(worker),
                self.config.prefill_weight,
            )
        chosen = pick_lowest(candidates, lambda w: costs[w])
        assert chosen is not None
        best = max(pool, key=lambda w: (hits[w], len(runs[w])))
        by_tier: dict[str, int] = {}
        for medium in runs[chosen]:
            by_tier[medium] = by_tier.get(medium, 0) + 1
        return Choice(
            chosen, "kv_aware", cached_blocks=len(runs[chosen]), credited_blocks=hits[chosen],
            cached_by_tier=by_tier, prompt_blocks=route.full_blocks(self._block_size(chosen)),
            best_cached_blocks=len(runs[best]), best_credited_blocks=hits[best],
            best_skipped="load bound" if best not in costs else f"cost {costs[best] - costs[chosen]:+.0f}",
        )

    def credits_for(self, worker: WorkerEndpoint) -> dict[str, float]:
        """The fixed credits, with the tiers left to measurement set from the worker's report."""
        if not self._measured or worker.load is None:
            return self._credits
        measured = measured_credits(worker.load.raw, self._measured)
        return {**self._credits, **measured} if measured else self._credits

    def reads_cluster(self, worker: WorkerEndpoint) -> bool:
        """Whether the worker can load from the cluster store, so the pool's cluster set counts
        for it: it has reported cluster blocks, or its /load lists the medium."""
        if self.index.writes_cluster(worker.url):
            return True
        raw = worker.load.raw if worker.load is not None else {}
        tiers = raw.get("kv_tiers")
        media = tiers.get("media") if isinstance(tiers, dict) else None
        return isinstance(media, dict) and CLUSTER in media

    def _least_tokens(
        self, pool: Sequence[WorkerEndpoint], route: PromptRoute, hop: HopName
    ) -> Choice:
        if hop == "prefill":
            chosen = pick_prefill(pool, route.prompt_tokens)
        else:
            chosen = pick_decode(pool, route.prompt_tokens, self.scoring.decode_sequence_weight)
        assert chosen is not None
        return Choice(chosen, "least_tokens")

    def _block_size(self, worker: WorkerEndpoint) -> int:
        size = self.index.block_size(worker.url)
        if size:
            return size
        return worker.load.block_size if worker.load is not None else 16
