"""Routing policies: which worker of a pool serves a request's first hop (no I/O here).

An affinity key, when the request has one, decides first under every policy: the worker is
the key's owner on a consistent-hash ring over the pool's healthy workers, walking on past
any worker whose in-flight requests would exceed ⌈c × average⌉ (c = `--balance-factor`,
1.25). Keys come from `x-session-affinity`, then `--affinity-header`, then the body's `user`.

Without a key, `--policy`:

- `kv_aware` (default): the worker with the lowest cost, in tokens,

      cost = w × prefill_tokens + decode_tokens                            w = 4.0
      prefill_tokens = waiting prefill tokens + unreflected prefill tokens
                       + max(0, prompt tokens − cached_blocks × B)
      decode_tokens  = running KV tokens + unreflected decode tokens

  where `cached_blocks` is the longest prefix of the prompt's block-hash chain (blocks of B
  tokens) that the worker holds, from its KV events. This is Dynamo's `w × uncached prefill
  blocks + decode blocks`, times B so that workers with different block sizes compare, and
  with the worker's queue counted in: a hit is worth the prefill it saves, and a worker whose
  queue outweighs its hit loses to an idle one. Queues count only tokens still to compute:
  workers report waiting requests net of the cached prefix they found on arrival, and the
  router counts what it has just sent by the uncached tokens it predicted for that worker.
  Dynamo weighs the two terms equally (w = 1); here w = 4, because a prefill token costs a
  forward pass while a running sequence's KV token costs one attention read per decode step:
  with w = 1 an agent's turn, 90% cached on a worker that was decoding another long session,
  moved to an idle worker and recomputed thousands of tokens there. Once the pool is busy (on
  average a request in flight per worker), workers at the load bound are skipped as for
  sessions, so one hot prefix cannot pile every request onto one worker; below that the cost
  alone decides, because batching a request with one or two others costs far less than
  recomputing its prompt elsewhere. Without the prompt's tokens (the tokenize hop failed or
  timed out, or no worker has cached anything yet) it routes as `least_tokens`.
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
from tandem.router.config import PolicyConfig, ScoringConfig
from tandem.router.placement.kv_index import KvIndex
from tandem.router.placement.ring import HashRing, bounded_pick, load_bound
from tandem.router.placement.scoring import pick_decode, pick_lowest, pick_prefill
from tandem.router.workers.registry import LoadSnapshot, Worker

AFFINITY_HEADER = "x-session-affinity"
# A hop's name: "prefill" and "decode" (PD mode) or "direct" (a whole request on one worker).
HopName = str
_MAX_RINGS = 32  # rings cached per distinct healthy pool; pools change rarely


def affinity_key(
    headers: Mapping[str, str], body: Mapping[str, Any], extra_header: str | None
) -> str | None:
    """x-session-affinity, then the configured header, then the OpenAI `user` field."""
    for name in (AFFINITY_HEADER, extra_header):
        if name:
            value = headers.get(name)
            if value:
                return value
    user = body.get("user")
    return user if isinstance(user, str) and user else None


@dataclass
class PromptRoute:
    """What the policies know of one request; block hashes are computed lazily and kept."""

    prompt_tokens: int
    affinity_key: str | None = None
    token_ids: Sequence[int] | None = None
    notes: list[str] = field(default_factory=list)  # one per placement, for the log line
    # kv_aware: the prompt tokens each worker (by URL) would compute, after its cached prefix
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

    worker: Worker
    rule: str  # the rule that decided: session, kv_aware, least_tokens, round_robin
    cached_blocks: int = 0  # kv_aware: the predicted prefix hit on the chosen worker
    prompt_blocks: int = 0
    best_cached_blocks: int = 0  # kv_aware: the longest prefix any worker of the pool held
    best_skipped: str = ""  # kv_aware: why that worker lost (over the load bound, or its cost)
    overflow: int = 0  # session: ring owners passed over because they were full


def kv_cost(
    worker: Worker, cached_blocks: int, prompt_tokens: int, block_size: int, weight: float
) -> float:
    load = worker.load or LoadSnapshot()
    uncached = max(0, prompt_tokens - cached_blocks * block_size)
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

    def choose(self, pool: Sequence[Worker], route: PromptRoute, hop: HopName) -> Choice | None:
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

    def session(self, pool: Sequence[Worker], key: str) -> Choice:
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

    def kv_aware(self, pool: Sequence[Worker], route: PromptRoute) -> Choice:
        candidates = list(pool)
        loads = [w.in_flight for w in pool]
        if sum(loads) >= len(loads):  # the pool is busy: guard against hot spots
            bound = load_bound(loads, self.config.balance_factor)
            candidates = [w for w in pool if w.in_flight + 1 <= bound] or candidates
        cached = {
            w: self.index.cached_prefix(w.url, route.block_hash) for w in pool
        }
        for worker in pool:
            uncached = route.prompt_tokens - cached[worker] * self._block_size(worker)
            route.uncached[worker.url] = max(0, uncached)
        costs: dict[Worker, float] = {}
        for worker in candidates:
            costs[worker] = kv_cost(
                worker, cached[worker], route.prompt_tokens, self._block_size(worker),
                self.config.prefill_weight,
            )
        chosen = pick_lowest(candidates, lambda w: costs[w])
        assert chosen is not None
        best = max(pool, key=lambda w: cached[w])
        return Choice(
            chosen, "kv_aware", cached_blocks=cached[chosen],
            prompt_blocks=route.full_blocks(self._block_size(chosen)),
            best_cached_blocks=cached[best],
            best_skipped="load bound" if best not in costs else f"cost {costs[best] - costs[chosen]:+.0f}",
        )

    def _least_tokens(self, pool: Sequence[Worker], route: PromptRoute, hop: HopName) -> Choice:
        if hop == "prefill":
            chosen = pick_prefill(pool, route.prompt_tokens)
        else:
            chosen = pick_decode(pool, route.prompt_tokens, self.scoring.decode_sequence_weight)
        assert chosen is not None
        return Choice(chosen, "least_tokens")

    def _block_size(self, worker: Worker) -> int:
        size = self.index.block_size(worker.url)
        if size:
            return size
        return worker.load.block_size if worker.load is not None else 16
