"""Fixed request sets for `tandem bench offline`: the same token ids go to every engine.

Pure Python (no torch): the parent process builds the workloads once, writes them into each
run's spec file, and every engine (tandem, transformers, vLLM in its own venv) reads the
same token ids from there.

Workloads (at scale 1.0):

- ``decode-heavy``: 64 prompts of 32-128 random tokens, 128 output tokens each, one batch.
- ``prefill-heavy``: 24 prompts of 256-1024 random tokens, 16 output tokens each, one batch.
- ``single-stream``: pairs of different 64-token prompts run one request at a time, one with
  129 output tokens and one with 1; decode tok/s = 128 / (t(129) - t(1)), so prefill cancels
  and the prefix cache cannot help the second prompt of a pair.
- ``long-prompt`` (not run by default): one 8,000-token prompt and one output token, the
  first turn of an agent harness (system prompt, tool definitions, files) with nothing
  cached: its time to first token. Chunked prefill makes most of its chunks attend to a
  cached prefix, where attention, quadratic in the length, outweighs the GEMMs.

Every request is greedy with ignore_eos, so each engine generates exactly max_tokens tokens.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

WORKLOAD_NAMES = ("decode-heavy", "prefill-heavy", "single-stream", "long-prompt")
DEFAULT_WORKLOADS = ("decode-heavy", "prefill-heavy", "single-stream")
LONG_PROMPT_LEN = 8000

# Token ids below this are skipped: the low ids of most BPE vocabularies are special or
# byte-fallback tokens, which random prompts should not be made of.
FIRST_ORDINARY_TOKEN = 100
SINGLE_STREAM_PROMPT_LEN = 64
SINGLE_STREAM_LONG_OUTPUT = 129
SINGLE_STREAM_REPEATS = 3
WARMUP_PROMPT_LEN = 16
WARMUP_OUTPUT = 2

_SEEDS = {"decode-heavy": 1001, "prefill-heavy": 2002, "single-stream": 3003, "warmup": 4004,
          "long-prompt": 5005}


@dataclass(frozen=True)
class Workload:
    """A request set. ``mode`` is "batch" (all requests in one generate call, timed as one)
    or "sequential" (one generate call per request, each timed on its own)."""

    name: str
    mode: str
    prompts: list[list[int]]
    max_tokens: list[int]
    description: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Workload:
        return cls(**data)

    def summary(self) -> dict[str, Any]:
        lengths = [len(p) for p in self.prompts]
        return {
            "mode": self.mode,
            "description": self.description,
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "prompt_len_min": min(lengths),
            "prompt_len_max": max(lengths),
            "max_tokens": sorted(set(self.max_tokens)),
            **self.meta,
        }


def _scaled(value: int, scale: float, floor: int) -> int:
    return max(floor, round(value * scale))


def _random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    low = FIRST_ORDINARY_TOKEN if vocab_size > 2 * FIRST_ORDINARY_TOKEN else 0
    return [rng.randrange(low, vocab_size) for _ in range(length)]


def _batch(name: str, count: int, min_len: int, max_len: int, output: int, scale: float,
           vocab_size: int, seed: int) -> Workload:
    rng = random.Random(_SEEDS[name] + seed)
    count = _scaled(count, scale, 1)
    lo, hi = _scaled(min_len, scale, 4), _scaled(max_len, scale, 4)
    out = _scaled(output, scale, 2)
    prompts = [_random_prompt(rng, rng.randint(lo, hi), vocab_size) for _ in range(count)]
    return Workload(
        name=name, mode="batch", prompts=prompts, max_tokens=[out] * count,
        description=f"{count} prompts of {lo}-{hi} tokens, {out} output tokens each",
    )


def _single_stream(scale: float, vocab_size: int, seed: int) -> Workload:
    rng = random.Random(_SEEDS["single-stream"] + seed)
    length = _scaled(SINGLE_STREAM_PROMPT_LEN, scale, 8)
    long_out = _scaled(SINGLE_STREAM_LONG_OUTPUT - 1, scale, 2) + 1
    repeats = _scaled(SINGLE_STREAM_REPEATS, scale, 1)
    prompts, max_tokens = [], []
    for _ in range(repeats):
        # Two different prompts of one length: prefill costs the same, nothing is cached.
        prompts += [_random_prompt(rng, length, vocab_size), _random_prompt(rng, length, vocab_size)]
        max_tokens += [long_out, 1]
    return Workload(
        name="single-stream", mode="sequential", prompts=prompts, max_tokens=max_tokens,
        description=f"{repeats} x ({long_out} vs 1 output tokens) on different {length}-token prompts, one at a time",
        meta={"pairs": repeats},
    )


def build_workload(name: str, vocab_size: int, scale: float = 1.0, seed: int = 0) -> Workload:
    if scale <= 0:
        raise ValueError(f"--scale must be > 0, got {scale}")
    if name == "decode-heavy":
        return _batch(name, 64, 32, 128, 128, scale, vocab_size, seed)
    if name == "prefill-heavy":
        return _batch(name, 24, 256, 1024, 16, scale, vocab_size, seed)
    if name == "single-stream":
        return _single_stream(scale, vocab_size, seed)
    if name == "long-prompt":
        length = _scaled(LONG_PROMPT_LEN, scale, 64)
        prompt = _random_prompt(random.Random(_SEEDS[name] + seed), length, vocab_size)
        return Workload(name=name, mode="sequential", prompts=[prompt], max_tokens=[1],
                        description=f"one {length}-token prompt, 1 output token: time to first token")
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")


def warmup_prompt(vocab_size: int, seed: int = 0) -> list[int]:
    """A short prompt every engine runs once after start-up, before any timed request."""
    return _random_prompt(random.Random(_SEEDS["warmup"] + seed), WARMUP_PROMPT_LEN, vocab_size)


def compute_metrics(workload: Workload, result: dict[str, Any]) -> dict[str, float | None]:
    """Throughput numbers from one run's raw timings (``request_seconds``, ``elapsed_s``)."""
    metrics: dict[str, float | None] = {
        "output_tok_s": None, "prompt_tok_s": None, "decode_tok_s": None,
    }
    if workload.mode == "batch":
        elapsed = result["elapsed_s"]
        metrics["output_tok_s"] = result["output_tokens"] / elapsed if elapsed > 0 else None
        metrics["prompt_tok_s"] = result["prompt_tokens"] / elapsed if elapsed > 0 else None
        return metrics
    times = result["request_seconds"]
    if workload.name == "long-prompt":
        metrics["ttft_s"] = times[0]
        metrics["prompt_tok_s"] = result["prompt_tokens"] / times[0] if times[0] > 0 else None
        return metrics
    rates = []
    for i in range(0, len(times) - 1, 2):
        extra = workload.max_tokens[i] - workload.max_tokens[i + 1]
        delta = times[i] - times[i + 1]
        if delta > 0:
            rates.append(extra / delta)
    metrics["decode_tok_s"] = statistics.median(rates) if rates else None
    return metrics
