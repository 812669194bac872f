"""Load or recompute: the decision a slow tier must win to be used.

A tier hit is only worth taking when reading the chunk costs less than computing its tokens
again; SGLang users found a file tier at 2.45 s TTFT against 1.73 s for recomputing (#26305).
So every candidate chunk is priced both ways from figures measured on this worker:

    load seconds      = latency[tier] + bytes / bandwidth[tier]
    recompute seconds = tokens / prefill tokens per second

Bandwidth and latency per tier come from real loads (seconds and bytes the worker side reports
for each), the prefill rate from real steps (tokens scheduled over the step's wall time, for
steps with enough prompt tokens to be prefill-bound); both are exponential moving averages, so
they follow a disk that fills its page cache or a store that gets busy. Until a tier has been
measured, a conservative prior stands in (slow enough that a prior alone never picks a remote
store over a fast model), and the first load of each tier is taken regardless, so it gets
measured. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Priors: bytes/s and seconds per chunk, replaced by measurements after the first loads.
_PRIOR_BANDWIDTH = {"cpu": 2e9, "disk": 400e6, "cluster": 200e6, "mooncake": 200e6}
_PRIOR_LATENCY = {"cpu": 1e-4, "disk": 1e-3, "cluster": 2e-3, "mooncake": 2e-3}
_PRIOR_PREFILL_TPS = 2000.0
_MIN_PREFILL_STEP_TOKENS = 64  # smaller steps are decode-bound: they say little about prefill


@dataclass
class _Ema:
    value: float
    samples: int = 0
    alpha: float = 0.3

    def add(self, sample: float) -> None:
        self.value = sample if self.samples == 0 else (1 - self.alpha) * self.value + self.alpha * sample
        self.samples += 1


@dataclass
class CostModel:
    enabled: bool = True
    bandwidth: dict[str, _Ema] = field(default_factory=lambda: {k: _Ema(v) for k, v in _PRIOR_BANDWIDTH.items()})
    latency: dict[str, _Ema] = field(default_factory=lambda: {k: _Ema(v) for k, v in _PRIOR_LATENCY.items()})
    prefill_tps: _Ema = field(default_factory=lambda: _Ema(_PRIOR_PREFILL_TPS))

    def observe_load(self, medium: str, num_bytes: int, seconds: float, num_chunks: int) -> None:
        """A finished load from one tier: `num_chunks` chunks, `num_bytes` in `seconds`."""
        if num_chunks <= 0 or seconds <= 0:
            return
        per_chunk = seconds / num_chunks
        bandwidth = self.bandwidth.setdefault(medium, _Ema(_PRIOR_BANDWIDTH["cluster"]))
        latency = self.latency.setdefault(medium, _Ema(_PRIOR_LATENCY["cluster"]))
        # One load gives one (bytes, seconds) point; attribute it to bandwidth, and keep the
        # latency prior small: per-chunk fixed costs show up as lower effective bandwidth.
        bandwidth.add(num_bytes / seconds)
        latency.add(min(latency.value, per_chunk))

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= _MIN_PREFILL_STEP_TOKENS and seconds > 0:
            self.prefill_tps.add(num_tokens / seconds)

    def measured(self, medium: str) -> bool:
        ema = self.bandwidth.get(medium)
        return ema is not None and ema.samples > 0

    def load_seconds(self, medium: str, num_bytes: int) -> float:
        bandwidth = self.bandwidth.get(medium) or _Ema(_PRIOR_BANDWIDTH["cluster"])
        latency = self.latency.get(medium) or _Ema(_PRIOR_LATENCY["cluster"])
        return latency.value + num_bytes / bandwidth.value

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tps.value

    def worth_loading(self, medium: str, num_bytes: int, num_tokens: int) -> bool:
        """Whether loading `num_bytes` from `medium` beats computing `num_tokens` here."""
        if not self.enabled or not self.measured(medium):
            return True
        return self.load_seconds(medium, num_bytes) < self.recompute_seconds(num_tokens)

    def describe(self) -> dict[str, float]:
        out = {"prefill_tokens_per_s": round(self.prefill_tps.value, 1)}
        for medium, ema in self.bandwidth.items():
            if ema.samples:
                out[f"{medium}_bytes_per_s"] = round(ema.value)
        return out
