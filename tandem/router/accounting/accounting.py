"""What a request costs and who pays: the price on each response and the ledger row after it.

The proxy calls `with_cost` on every usage object it sends a client (whole replies and the
usage chunk of streams) and `record` once per finished request. Usage comes from the workers:
in PD mode `merge.merged_usage` has already taken prompt and cached tokens from the prefill
worker (the one that read the prompt) and completion tokens from the decode worker, so cached
tokens are counted once, as the worker that served them counted them.

A request that ends without usage from the workers (the client disconnected mid-stream, or
the decode hop broke) still gets a ledger row, status `aborted` or `error`, with `estimated`
set and the tokens the router saw: prompt and cached tokens from the prefill hop's reply when
there was one (else the router's own prompt count), and one completion token per output chunk
it relayed. A request that failed before any worker produced anything is recorded with zero
tokens (it shows up in the request counts, not in the bill).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.router.accounting.auth import ANONYMOUS, ApiKeys, Caller, KeyFile, worker_headers
from tandem.router.accounting.keys_store import KeyLimits
from tandem.router.accounting.ledger import Ledger, UsageRow
from tandem.router.accounting.limits import DailyQuota, RateLimiter
from tandem.router.accounting.pricing import (
    PriceTable,
    cached_tokens,
    cost,
    read_price_file,
    usage_cost,
)
from tandem.router.config import AccountingConfig
from tandem.router.pd.merge import Identity
from tandem.router.workers.registry import WorkerEndpoint

_USER_MAX_CHARS = 256


class FinishedCall(Protocol):
    """What `record` reads from the proxy's per-request state (http/call.py's Call)."""

    identity: Identity
    kind: str
    protocol: str
    reply_id: str | None
    body: dict[str, Any]
    caller: str
    route: str
    status: int
    usage: dict[str, Any] | None
    prefill_usage: dict[str, Any] | None
    prompt_tokens: int
    output_chunks: int
    prefill_worker: WorkerEndpoint | None
    decode_worker: WorkerEndpoint | None
    received: float


@dataclass
class Accounting:
    prices: PriceTable = field(default_factory=PriceTable)
    ledger: Ledger | None = None
    keys: ApiKeys | KeyFile | None = None
    worker_api_key: str | None = field(default=None, repr=False)
    usage_admins: frozenset[str] = frozenset()
    rate_limits: RateLimiter = field(default_factory=lambda: RateLimiter(KeyLimits()))
    quota: DailyQuota = field(default_factory=lambda: DailyQuota(KeyLimits(), None))

    async def admit(self, caller: Caller, prompt_tokens: int) -> None:
        """The caller's rate limits and daily quota, or a 429 (limits.py)."""
        await self.quota.check(caller)
        self.rate_limits.admit(caller, prompt_tokens)

    def settle(self, caller: Caller, admitted_prompt: int, usage: dict[str, Any] | None) -> None:
        """What an admitted request used beyond the prompt tokens taken at admission (the
        router's count), for the next admissions."""
        completion = int((usage or {}).get("completion_tokens") or 0)
        prompt = int((usage or {}).get("prompt_tokens") or admitted_prompt)
        self.rate_limits.charge(caller, max(0, prompt - admitted_prompt) + completion)
        self.quota.charge(caller.identity, prompt + completion)

    @property
    def keys_on(self) -> bool:
        return self.keys is not None

    def worker_headers(self, client: Mapping[str, str]) -> dict[str, str]:
        return worker_headers(client, self.keys_on, self.worker_api_key)

    def with_cost(self, usage: dict[str, Any], model: str) -> dict[str, Any]:
        return {**usage, "cost": usage_cost(usage, self.prices.price(model))}

    def pricer(self, model: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
        return lambda usage: self.with_cost(usage, model)

    def priced_reply(self, reply: dict[str, Any], model: str) -> dict[str, Any]:
        usage = reply.get("usage")
        if not isinstance(usage, dict):
            return reply
        return {**reply, "usage": self.with_cost(usage, model)}

    def record(self, call: FinishedCall, end: float) -> None:
        """One ledger row for a finished request (`end` is time.monotonic())."""
        if self.ledger is None:
            return
        self.ledger.record(self.row(call, end))

    def row(self, call: FinishedCall, end: float) -> UsageRow:
        model = call.identity.model
        usage = call.usage
        estimated = usage is None
        if usage is not None:
            prompt = int(usage.get("prompt_tokens") or 0)
            cached = cached_tokens(usage)
            completion = int(usage.get("completion_tokens") or 0)
        elif call.prefill_usage is not None or call.output_chunks:
            known = call.prefill_usage or {}
            prompt = int(known.get("prompt_tokens") or call.prompt_tokens)
            cached = cached_tokens(known)
            completion = call.output_chunks
        else:
            prompt = cached = completion = 0
        price = cost(prompt, cached, completion, self.prices.price(model))
        user = call.body.get("user")
        return UsageRow(
            time=time.time() - (end - call.received),
            identity=call.caller or ANONYMOUS,
            user=user[:_USER_MAX_CHARS] if isinstance(user, str) else None,
            model=model,
            endpoint=call.protocol,  # the client's protocol: messages, responses, chat...
            request_id=call.reply_id or call.identity.id,
            route=call.route,
            prefill_worker=call.prefill_worker.url if call.prefill_worker else None,
            decode_worker=call.decode_worker.url if call.decode_worker else None,
            status=status_name(call.status),
            http_status=call.status,
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
            estimated=estimated,
            cost_input=price["input"],
            cost_cached_input=price["cached_input"],
            cost_output=price["output"],
            cost_total=price["total"],
        )

    def describe(self) -> str:
        """One start-up log line: where the ledger is, how many prices and keys."""
        ledger = f"usage ledger {self.ledger.path.resolve()}" if self.ledger else "no usage ledger"
        priced = len(self.prices.exact) + len(self.prices.patterns)
        prices = f"prices for {priced} model name(s)" if priced else "no prices (costs are 0)"
        keys = (
            f"{len(self.keys)} API key(s) for {len(self.keys.identities)} identities"
            if self.keys is not None
            else "no API keys (/v1 is open)"
        )
        return f"{ledger}; {prices}; {keys}"

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()


def load_keys(config: AccountingConfig) -> KeyFile | None:
    return KeyFile(config.api_keys_file) if config.api_keys_file is not None else None


def open_accounting(
    config: AccountingConfig,
    keys: ApiKeys | KeyFile | None,
    on_batch: Callable[[int, bool], None] | None = None,
) -> Accounting:
    """Read the price file and start the ledger's writer (close it with `close`)."""
    prices = read_price_file(config.prices_file) if config.prices_file else PriceTable()
    ledger = None
    if config.ledger_path is not None:
        ledger = Ledger(config.ledger_path, on_batch=on_batch).start()
    defaults = KeyLimits(config.rate_limit_rpm, config.rate_limit_tpm, config.quota_tokens_per_day)

    def ledger_tokens(identity: str, start: float, end: float) -> int:
        assert ledger is not None
        totals = ledger.totals(start, end, identity).get(identity)
        return 0 if totals is None else int(totals.prompt_tokens + totals.completion_tokens)

    return Accounting(
        prices,
        ledger,
        keys,
        config.worker_api_key,
        frozenset(config.usage_admins),
        RateLimiter(defaults),
        DailyQuota(defaults, ledger_tokens if ledger is not None else None),
    )


def status_name(http_status: int) -> str:
    if http_status == 499:
        return "aborted"
    return "ok" if http_status < 400 else "error"
