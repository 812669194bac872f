"""`GET /v1/usage`: totals per identity over a time range, read from the ledger.

Query parameters (all optional):
    identity  whose usage; `*` for everyone. Default: the caller's own identity when API keys
              are on (a caller may only read its own unless it is a `--usage-admin`);
              everyone when keys are off.
    user      only requests whose `user` field was this.
    start     ISO 8601 (`2026-11-21`, `2026-11-21T10:00:00Z`; no zone means UTC) or unix
              seconds; inclusive. Default: the ledger's first row.
    end       the same; exclusive. Default: now.

The ledger is flushed first, so a request that has finished is in the answer.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from tandem.edge.errors import APIError
from tandem.router.accounting.accounting import Accounting
from tandem.router.accounting.ledger import Totals
from tandem.router.accounting.pricing import CURRENCY

_FLUSH_TIMEOUT_S = 5.0
ALL = "*"


def parse_time(value: str, param: str) -> float:
    """Unix seconds from unix seconds or ISO 8601 (naive means UTC)."""
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise APIError(400, f"{param}: not a finite time: {value!r}", code="invalid_value")
        return seconds
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise APIError(
            400,
            f"{param}: expected ISO 8601 (2026-11-21T10:00:00Z) or unix seconds, got {value!r}",
            code="invalid_value",
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.timestamp()


def iso(seconds: float) -> str:
    moment = dt.datetime.fromtimestamp(seconds, dt.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def whose(accounting: Accounting, caller: str, asked: str | None) -> str | None:
    """The identity to report (None: everyone), or 403 when the caller may not see it."""
    if not accounting.keys_on:
        return None if asked in (None, "", ALL) else asked
    if asked in (None, ""):
        return caller
    if asked != caller and caller not in accounting.usage_admins:
        raise APIError(
            403,
            f"the key of {caller!r} may read only its own usage (identity={caller})",
            code="permission_denied",
        )
    return None if asked == ALL else asked


def _totals_json(totals: Totals) -> dict[str, Any]:
    values = asdict(totals)
    return {
        "requests": values["requests"],
        "aborted": values["aborted"],
        "errors": values["errors"],
        "prompt_tokens": values["prompt_tokens"],
        "cached_tokens": values["cached_tokens"],
        "completion_tokens": values["completion_tokens"],
        "cost": {
            "input": round(values["cost_input"], 10),
            "cached_input": round(values["cost_cached_input"], 10),
            "output": round(values["cost_output"], 10),
            "total": round(values["cost_total"], 10),
            "currency": CURRENCY,
        },
    }


async def usage_report(
    accounting: Accounting, caller: str, params: Mapping[str, str]
) -> dict[str, Any]:
    ledger = accounting.ledger
    if ledger is None:
        raise APIError(
            404,
            "the usage ledger is off (the router runs with --no-ledger)",
            code="ledger_disabled",
        )
    identity = whose(accounting, caller, params.get("identity"))
    user = params.get("user") or None
    now = time.time()
    end = parse_time(params["end"], "end") if params.get("end") else now
    await asyncio.to_thread(ledger.flush, _FLUSH_TIMEOUT_S)
    if params.get("start"):
        start = parse_time(params["start"], "start")
    else:
        first = await asyncio.to_thread(ledger.first_time)
        start = min(first, end) if first is not None else min(now, end)
    if start > end:
        raise APIError(400, "start must not be after end", code="invalid_value")
    by_identity = await asyncio.to_thread(ledger.totals, start, end, identity, user)
    total = sum(by_identity.values(), Totals())
    return {
        "object": "usage",
        "start": iso(start),
        "end": iso(end),
        "start_unix": start,
        "end_unix": end,
        "identity": identity if identity is not None else ALL,
        "user": user,
        "data": [{"identity": name, **_totals_json(t)} for name, t in by_identity.items()],
        "total": _totals_json(total),
    }

