"""Which worker gets a request: the lowest score, counted in tokens rather than requests.

Requests differ by orders of magnitude in size (a 20-token question, a 30 000-token agent
turn), so counting requests balances nothing. Both scores use the worker's last `GET /load`
(polled every 0.5 s) plus what the router has routed to it since that the poll cannot show
yet ("unreflected" tokens: see `WorkerEndpoint.on_load`).

Prefill score (prefill hop), in tokens the worker must still prefill before this request is
done:

    prefill = num_waiting_prefill_tokens + unreflected prefill tokens + this prompt's tokens

Decode score (decode hop, and whole requests sent to a decode or colocated worker), the
fraction of the worker's KV cache that would be in use, plus a small per-sequence term
because each running sequence also costs step time:

    decode = (running_kv_tokens + num_waiting_prefill_tokens + unreflected tokens
              + this request's tokens) / (kv_blocks_total × block_size)
             + w × (running + waiting + unreflected requests)        w = 0.01 by default

Dividing by capacity makes workers with different KV budgets comparable. Ties go to the
worker with fewer requests in flight through this router, then to the least recently chosen.
A worker not polled yet counts as empty with the largest capacity seen in its pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tandem.router.workers.registry import LoadSnapshot, WorkerEndpoint

_UNKNOWN_CAPACITY = 1 << 20


def prefill_score(worker: WorkerEndpoint, prompt_tokens: int) -> float:
    queued = worker.load.waiting_prefill_tokens if worker.load else 0
    return float(queued + worker.unreflected_tokens("prefill") + prompt_tokens)


def decode_score(
    worker: WorkerEndpoint,
    request_tokens: int,
    sequence_weight: float,
    fallback_capacity: int = _UNKNOWN_CAPACITY,
) -> float:
    load = worker.load or LoadSnapshot()
    capacity = load.kv_capacity_tokens or fallback_capacity
    tokens = (
        load.running_kv_tokens
        + load.waiting_prefill_tokens
        + worker.unreflected_tokens()
        + request_tokens
    )
    sequences = load.running_requests + load.waiting_requests + worker.unreflected_requests()
    return tokens / max(capacity, 1) + sequence_weight * sequences


def pool_capacity(workers: Sequence[WorkerEndpoint]) -> int:
    known = [w.load.kv_capacity_tokens for w in workers if w.load and w.load.kv_capacity_tokens]
    return max(known) if known else _UNKNOWN_CAPACITY


def pick_lowest(
    workers: Sequence[WorkerEndpoint], score: Callable[[WorkerEndpoint], float]
) -> WorkerEndpoint | None:
    if not workers:
        return None
    return min(workers, key=lambda w: (score(w), w.in_flight, w.last_picked))


def pick_prefill(workers: Sequence[WorkerEndpoint], prompt_tokens: int) -> WorkerEndpoint | None:
    return pick_lowest(workers, lambda w: prefill_score(w, prompt_tokens))


def pick_decode(
    workers: Sequence[WorkerEndpoint], request_tokens: int, sequence_weight: float
) -> WorkerEndpoint | None:
    capacity = pool_capacity(workers)
    return pick_lowest(
        workers, lambda w: decode_score(w, request_tokens, sequence_weight, capacity)
    )
