"""Prices per model (`--prices FILE`) and what one response's usage costs.

Prices are USD per 1M tokens, split three ways because agent traffic is input-heavy and
mostly cached: prompt tokens the worker computed (`input`), prompt tokens served from its
prefix cache (`cached_input`, discounted because their prefill was skipped), and generated
tokens (`output`). So a request costs

    (prompt_tokens - cached_tokens) * input + cached_tokens * cached_input
    + completion_tokens * output, all / 1e6

File (JSON, or YAML for .yaml / .yml), model name -> price; `cached_input` defaults to
`input` (no discount), a missing `input` or `output` to 0:

    {"smollm2-135m": {"input": 0.10, "cached_input": 0.025, "output": 0.40},
     "llama-*": {"input": 0.20, "output": 0.80},
     "*": {"input": 0.05, "output": 0.20}}

A model is looked up by the name the client sent: an exact key first, then the keys holding
`*` / `?` / `[` as shell patterns in file order (`"*"` matches everything, so it is the
default). A model no key matches is free (all prices 0): a router without a price file still
reports costs, all zero, instead of refusing requests.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.router.accounting.datafile import parse_structured, read_text

CURRENCY = "USD"
_PRICE_KEYS = ("input", "cached_input", "output")
_PATTERN_CHARS = ("*", "?", "[")


@dataclass(frozen=True)
class Price:
    """USD per 1M tokens."""

    input: float = 0.0
    cached_input: float = 0.0
    output: float = 0.0


FREE = Price()


@dataclass(frozen=True)
class PriceTable:
    exact: Mapping[str, Price] = field(default_factory=dict)
    patterns: tuple[tuple[str, Price], ...] = ()  # in file order; "*" is a pattern too

    def price(self, model: str) -> Price:
        found = self.exact.get(model)
        if found is not None:
            return found
        for pattern, price in self.patterns:
            if fnmatch.fnmatchcase(model, pattern):
                return price
        return FREE


def cached_tokens(usage: Mapping[str, Any]) -> int:
    details = usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0) if isinstance(details, Mapping) else 0


def cost(prompt: int, cached: int, completion: int, price: Price) -> dict[str, Any]:
    """The `usage.cost` object; amounts rounded to 1e-10 USD so sums stay readable."""
    cached = max(0, min(cached, prompt))
    parts = {
        "input": (prompt - cached) * price.input / 1e6,
        "cached_input": cached * price.cached_input / 1e6,
        "output": max(0, completion) * price.output / 1e6,
    }
    out: dict[str, Any] = {name: round(value, 10) for name, value in parts.items()}
    out["total"] = round(sum(parts.values()), 10)
    out["currency"] = CURRENCY
    return out


def usage_cost(usage: Mapping[str, Any], price: Price) -> dict[str, Any]:
    return cost(
        int(usage.get("prompt_tokens") or 0),
        cached_tokens(usage),
        int(usage.get("completion_tokens") or 0),
        price,
    )


def parse_price_data(data: Any, what: str = "the price file") -> PriceTable:
    if data is None:
        return PriceTable()
    if not isinstance(data, dict):
        raise ValueError(
            f"{what} must map model names to prices, e.g. "
            '{"my-model": {"input": 0.10, "cached_input": 0.025, "output": 0.40}}'
        )
    exact: dict[str, Price] = {}
    patterns: list[tuple[str, Price]] = []
    for model, entry in data.items():
        price = _parse_price(entry, f"{what}: model {model!r}")
        name = str(model)
        if any(c in name for c in _PATTERN_CHARS):
            patterns.append((name, price))
        else:
            exact[name] = price
    # "*" matches everything: whatever its place in the file, more specific patterns first.
    patterns.sort(key=lambda item: item[0] == "*")
    return PriceTable(exact, tuple(patterns))


def _parse_price(entry: Any, where: str) -> Price:
    if not isinstance(entry, dict):
        raise ValueError(
            f"{where}: expected {{input, cached_input, output}} in USD per 1M tokens, "
            f"got {entry!r}"
        )
    unknown = sorted(str(k) for k in entry if k not in _PRICE_KEYS)
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(unknown)} (expected input, cached_input, output)"
        )
    values: dict[str, float] = {}
    for key in _PRICE_KEYS:
        if key not in entry or entry[key] is None:
            continue
        value = entry[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: {key} must be a number (USD per 1M tokens), got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}: {key} must be a finite number >= 0, got {value!r}")
        values[key] = float(value)
    input_price = values.get("input", 0.0)
    return Price(input_price, values.get("cached_input", input_price), values.get("output", 0.0))


def read_price_file(path: Path) -> PriceTable:
    what = f"price file {path}"
    return parse_price_data(parse_structured(read_text(path, "price file"), path.suffix, what), what)
