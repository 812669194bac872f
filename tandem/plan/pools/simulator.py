"""A discrete-event simulation of a tandem cluster serving a workload.

What is modelled, after tandem's own components:

- Router (tandem route, --policy kv_aware): a request goes to the worker with the lowest
  4 x (queued prompt tokens + its own uncached tokens) + running KV tokens, among those
  under the in-flight bound (1.25 x the average) when the pool is busy. With a prefill pool,
  prompts of at least `pd_min_prompt_tokens` are split: prefill on a prefill worker, then
  the KV handoff, then decoding on the least loaded decode worker; shorter prompts go whole
  to a decode worker. Each hop costs `http_overhead_s`.
- Engine (continuous batching, chunked prefill): a step takes every decoding sequence (up
  to `max_num_seqs`) and fills the rest of the `max_num_batched_tokens` budget with prompt
  chunks, oldest first; it lasts what the cost model says for that step's shape.
- Prefix cache: a worker remembers each session's last prompt (and, when it decoded it
  too, the output) in whole blocks, and the shared system prefix once it has computed it;
  capacity is assumed to suffice (no eviction).
- Prefill/decode handoff: the first token reaches the client when the prefill step that
  computed it ends (tandem's router streams it at once); the decode worker starts after
  `transfer_s(prompt tokens)`.

Not modelled: preemption for KV space, speculative decoding, failures, network contention.
Client-side figures, as `tandem bench serve` measures them: TTFT from sending to the first
token; time per output token as (last token - first token) / (output tokens - 1).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.plan.pools.costs import CostModel, StepShape
from tandem.plan.pools.traffic import SimRequest, SimSession, SimWorkload


@dataclass(frozen=True)
class Layout:
    """Worker counts: a prefill and a decode pool, or colocated workers (or both)."""

    prefill: int = 0
    decode: int = 0
    colocated: int = 0

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("worker counts must be >= 0")
        if self.prefill and not self.decode:
            raise ValueError("a prefill pool needs decode workers to hand its KV to")
        if not (self.decode or self.colocated):
            raise ValueError("a layout needs decode or colocated workers")

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.colocated

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    def describe(self) -> str:
        parts = []
        if self.prefill:
            parts.append(f"{self.prefill}P+{self.decode}D")
        elif self.decode:
            parts.append(f"{self.decode} decode")
        if self.colocated:
            parts.append(f"{self.colocated} colocated")
        return " + ".join(parts)


@dataclass(frozen=True)
class EngineLimits:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    block_size: int = 16  # the profiled engine's (CostModel.block_size); 16 for a bare EngineLimits()


@dataclass
class RequestOutcome:
    request: SimRequest
    arrival_s: float
    cached_tokens: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    split: bool = False

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.request.output_tokens < 2 or self.last_token_s is None or self.first_token_s is None:
            return None
        return (self.last_token_s - self.first_token_s) / (self.request.output_tokens - 1)

    @property
    def e2e_s(self) -> float:
        assert self.last_token_s is not None
        return self.last_token_s - self.arrival_s


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class SimResult:
    layout: Layout
    outcomes: list[RequestOutcome]
    duration_s: float
    busy_s: dict[str, float] = field(default_factory=dict)

    def ttft(self, q: float) -> float:
        return percentile([o.ttft_s for o in self.outcomes], q)

    def tpot(self, q: float) -> float:
        return percentile([t for o in self.outcomes if (t := o.tpot_s) is not None], q)

    @property
    def output_tokens_per_s(self) -> float:
        return sum(o.request.output_tokens for o in self.outcomes) / max(self.duration_s, 1e-9)

    @property
    def cached_ratio(self) -> float:
        prompt = sum(o.request.prompt_tokens for o in self.outcomes)
        return sum(o.cached_tokens for o in self.outcomes) / max(prompt, 1)

    def utilisation(self) -> dict[str, float]:
        return {name: busy / max(self.duration_s, 1e-9) for name, busy in self.busy_s.items()}

    def summary(self) -> dict[str, float]:
        return {"ttft_p50_s": self.ttft(50), "ttft_p90_s": self.ttft(90), "tpot_p50_s": self.tpot(50),
                "tpot_p90_s": self.tpot(90), "output_tokens_per_s": self.output_tokens_per_s,
                "cached_ratio": self.cached_ratio, "duration_s": self.duration_s}


@dataclass
class _Job:
    outcome: RequestOutcome
    session: SimSession
    prompt_tokens: int
    computed: int  # prompt tokens whose KV exists (cached or computed so far)
    generated: int = 0
    decode_to: _Worker | None = None  # the decode worker of a split request


class _Worker:
    def __init__(self, sim: _Simulation, name: str, role: str) -> None:
        self.sim, self.name, self.role = sim, name, role
        self.waiting: deque[_Job] = deque()
        self.running: list[_Job] = []
        self.busy = False
        self.busy_s = 0.0
        self.session_cache: dict[str, int] = {}  # tokens of the session's prefix held
        self.system_cached = False
        self.in_flight = 0  # requests here, from arrival until their last token here

    @property
    def waiting_prefill_tokens(self) -> int:
        return sum(job.prompt_tokens - job.computed for job in self.waiting)

    @property
    def running_kv_tokens(self) -> int:
        return sum(job.prompt_tokens + job.generated for job in self.running)

    def cached_for(self, session_id: str, prompt_tokens: int, system_tokens: int) -> int:
        block = self.sim.limits.block_size
        held = max(self.session_cache.get(session_id, 0), system_tokens if self.system_cached else 0)
        # the last prompt token is always computed: it yields the first output token
        return min(held, prompt_tokens - 1) // block * block

    def submit(self, job: _Job) -> None:
        self.waiting.append(job)
        self.in_flight += 1
        self.kick()

    def adopt_decoding(self, job: _Job) -> None:
        """A split request whose KV has arrived: it decodes here from its second token."""
        self.running.append(job)
        self.in_flight += 1
        self.kick()

    def kick(self) -> None:
        if self.busy or not (self.waiting or self.running):
            return
        limits = self.sim.limits
        decodes = self.running[: limits.max_num_seqs]
        budget = limits.max_num_batched_tokens - len(decodes)
        chunks: list[tuple[_Job, int]] = []
        for job in self.waiting:
            if budget <= 0 or len(decodes) + len(chunks) >= limits.max_num_seqs:
                break
            n = min(job.prompt_tokens - job.computed, budget)
            chunks.append((job, n))
            budget -= n
        shape = StepShape(tuple((n, job.computed) for job, n in chunks),
                          tuple(job.prompt_tokens + job.generated - 1 for job in decodes))
        duration = self.sim.costs.step_s(shape)
        self.busy = True
        self.busy_s += duration
        self.sim.at(self.sim.now + duration, lambda: self._end_step(decodes, chunks))

    def _end_step(self, decodes: list[_Job], chunks: list[tuple[_Job, int]]) -> None:
        now = self.sim.now
        costs = self.sim.costs
        self.busy = False
        for job in decodes:
            job.generated += 1
            if job.generated >= job.outcome.request.output_tokens:
                self.running.remove(job)
                self._finish(job, now)
        for job, n in chunks:
            job.computed += n
            if job.computed < job.prompt_tokens:
                continue
            self.waiting.remove(job)
            job.generated = 1  # the step that ends a prompt samples its first token
            job.outcome.first_token_s = now + costs.http_overhead_s
            if job.decode_to is None:
                self._remember(job.session.session_id, job.prompt_tokens + job.outcome.request.output_tokens)
            else:
                self._remember(job.session.session_id, job.prompt_tokens)
            if job.generated >= job.outcome.request.output_tokens:
                self._finish(job, now)
            elif job.decode_to is None:
                self.running.append(job)
            else:
                self.in_flight -= 1  # its prefill hop is over
                # the prefill reply reaches the router, the decode hop the decode worker,
                # which pulls the prompt's KV before its first step
                ready = now + 2 * costs.http_overhead_s + costs.transfer_s(job.prompt_tokens)
                self.sim.at(ready, lambda job=job, target=job.decode_to: target.adopt_decoding(job))
        self.kick()

    def _remember(self, session_id: str, tokens: int) -> None:
        self.system_cached = True
        self.session_cache[session_id] = tokens

    def _finish(self, job: _Job, now: float) -> None:
        self.in_flight -= 1
        job.outcome.last_token_s = now + self.sim.costs.http_overhead_s
        if self.role == "decode" and job.decode_to is self:
            # it received the prompt's KV and decoded the output: it holds the whole turn
            self._remember(job.session.session_id, job.prompt_tokens + job.outcome.request.output_tokens)
        self.sim.turn_done(job, job.outcome.last_token_s)


class _Simulation:
    def __init__(self, workload: SimWorkload, layout: Layout, costs: CostModel, limits: EngineLimits,
                 pd_min_prompt_tokens: int) -> None:
        self.workload, self.layout, self.costs, self.limits = workload, layout, costs, limits
        self.pd_min_prompt_tokens = pd_min_prompt_tokens
        self.prefill_weight = 4.0  # tandem route's defaults (PolicyConfig)
        self.balance_factor = 1.25
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.prefill = [_Worker(self, f"prefill-{i}", "prefill") for i in range(layout.prefill)]
        self.decode = [_Worker(self, f"decode-{i}", "decode") for i in range(layout.decode)]
        self.colocated = [_Worker(self, f"worker-{i}", "both") for i in range(layout.colocated)]
        self.outcomes: list[RequestOutcome] = []

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time, next(self._order), action))

    def run(self) -> SimResult:
        for session in self.workload.sessions:
            self.at(session.arrival_s, lambda s=session: self.send(s, 0, s.arrival_s))
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
        workers = [*self.prefill, *self.decode, *self.colocated]
        end = max((o.last_token_s or 0.0 for o in self.outcomes), default=0.0)
        start = min((s.arrival_s for s in self.workload.sessions), default=0.0)
        return SimResult(self.layout, self.outcomes, end - start, {w.name: w.busy_s for w in workers})

    def send(self, session: SimSession, turn: int, sent_s: float) -> None:
        spec = session.turns[turn]
        prompt = self.workload.prompt_tokens(session, turn)
        request = SimRequest(session.session_id, turn, prompt, spec.output_tokens)
        outcome = RequestOutcome(request, sent_s)
        self.outcomes.append(outcome)
        # the request reaches the worker one hop's overhead after it was sent
        self.at(sent_s + self.costs.http_overhead_s, lambda: self._route(outcome, session))

    def _route(self, outcome: RequestOutcome, session: SimSession) -> None:
        request = outcome.request
        split = bool(self.prefill) and request.prompt_tokens >= self.pd_min_prompt_tokens
        if split:
            first = self._pick(self.prefill, session, request.prompt_tokens)
            decode_to = min(self.decode, key=lambda w: (w.running_kv_tokens, w.in_flight, w.name))
        else:
            first = self._pick([*self.decode, *self.colocated], session, request.prompt_tokens)
            decode_to = None
        cached = first.cached_for(session.session_id, request.prompt_tokens, self.workload.system_tokens)
        outcome.cached_tokens, outcome.split = cached, split
        first.submit(_Job(outcome, session, request.prompt_tokens, cached, decode_to=decode_to))

    def _pick(self, pool: list[_Worker], session: SimSession, prompt_tokens: int) -> _Worker:
        """tandem route's kv_aware policy: the lowest prefill_weight x (queued prompt tokens
        + this prompt's uncached tokens) + running KV tokens, among the workers under the
        in-flight bound when the pool is busy."""
        loads = [w.in_flight for w in pool]
        candidates = list(range(len(pool)))
        if sum(loads) >= len(pool):
            bound = max(1, math.ceil(self.balance_factor * (sum(loads) + 1) / len(pool)))
            candidates = [i for i in candidates if loads[i] + 1 <= bound] or candidates
        system = self.workload.system_tokens

        def cost(i: int) -> tuple[float, int, int]:
            worker = pool[i]
            uncached = prompt_tokens - worker.cached_for(session.session_id, prompt_tokens, system)
            score = self.prefill_weight * (worker.waiting_prefill_tokens + uncached) + worker.running_kv_tokens
            return score, loads[i], i

        return pool[min(candidates, key=cost)]

    def turn_done(self, job: _Job, done_s: float) -> None:
        nxt = job.outcome.request.turn + 1
        if nxt < len(job.session.turns):
            self.at(done_s, lambda: self.send(job.session, nxt, done_s))


def simulate(workload: SimWorkload, layout: Layout, costs: CostModel, limits: EngineLimits | None = None,
             pd_min_prompt_tokens: int = 256) -> SimResult:
    """Run `workload` through `layout`; every request runs to its last token."""
    return _Simulation(workload, layout, costs, limits or EngineLimits(), pd_min_prompt_tokens).run()
