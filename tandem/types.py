"""Plain data shared by every layer of tandem: sampling parameters, requests and outputs.

Nothing here imports torch, so the scheduler, the router and the server can use these types
without paying for (or depending on) the model stack.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5
# A seed is an int64, as in vLLM: torch.Generator.manual_seed overflows (and, inside the
# engine, killed it) past 64 bits.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def wrap_seed(seed: int) -> int:
    """`seed` wrapped into [SEED_MIN, SEED_MAX], modulo 2**64."""
    return (seed - SEED_MIN) % 2**64 + SEED_MIN


@dataclass(frozen=True)
class GuidedDecoding:
    """What a request's output must match: exactly one of a JSON schema (`json`, as JSON text),
    any JSON object (`json_object`), a regular expression, one of `choice`'s strings, or a
    grammar (`grammar`: Lark, or GBNF/EBNF with `grammar_syntax="ebnf"`). Compiled into a
    token-level matcher in the engine core (tandem/structured); checked, and refused with a
    message naming the problem, at the edge. Plain data, so it crosses processes as is."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    grammar_syntax: str = "lark"  # or "ebnf"
    # Free text may come first, up to and including this (a reasoning block's end): the
    # constraint starts after it (docs/serving.md, "Structured outputs").
    starts_after: str | None = None

    def kinds(self) -> list[str]:
        """The constraints set, by name (a valid spec has exactly one)."""
        return [name for name, on in (("json", self.json is not None), ("json_object", self.json_object),
                                      ("regex", self.regex is not None), ("choice", self.choice is not None),
                                      ("grammar", self.grammar is not None)) if on]


@dataclass
class SamplingParams:
    """How to pick tokens for one request; the field names and defaults follow vLLM's."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # tandem: special tokens whose text stays in the output even with skip_special_tokens: a
    # tool-call format written in special tokens (Kimi-K2's sections) that its parser reads.
    preserved_token_ids: list[int] = field(default_factory=list)
    # tandem: False opts this request out of speculative decoding (its drafts are never
    # verified), e.g. a latency probe that must not share a step's extra tokens.
    speculate: bool = True
    # tandem: the output is constrained to a schema, regex, choice or grammar (structured outputs,
    # strict tool calls); None: free.
    guided: GuidedDecoding | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Reject values that would make sampling undefined, with messages a user can act on
        (each starts with the field's name). With `vocab_size`, top_k and stop_token_ids
        must also fit the vocabulary."""
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        # NaN fails every comparison below, so it would pass them all: finite first.
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [-2**63, 2**63 - 1], got {self.seed}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.guided is not None:
            if not isinstance(self.guided, GuidedDecoding):
                raise ValueError("guided must be a GuidedDecoding")
            if len(self.guided.kinds()) != 1:
                raise ValueError("guided decoding takes exactly one of json, json_object, regex, choice or "
                                 f"grammar; got {', '.join(self.guided.kinds()) or 'none'}")
        if vocab_size is not None:
            if self.top_k > vocab_size:
                raise ValueError(f"top_k must be at most the vocabulary size ({vocab_size}), or -1/0 to disable; "
                                 f"got {self.top_k}")
            bad = next((t for t in self.stop_token_ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"stop_token_ids must be token ids in [0, {vocab_size}), got {bad}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def for_child(self, index: int) -> SamplingParams:
        """Parameters of the index-th of n parallel samples: n=1 and a distinct seed."""
        # seed + index wraps into the int64 range rather than being refused: a seed near
        # SEED_MAX is valid and so is its n > 1. torch reads a seed modulo 2**64 (negative
        # ones as two's complement), so the wrapped seed gives the very generator that
        # seed + index would have, and the n children's seeds stay distinct.
        seed = None if self.seed is None else wrap_seed(self.seed + index)
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(n=1, seed=seed)
        return SamplingParams(**values)


# The longest a prompt-caching breakpoint keeps a prefix ahead of others (Anthropic's "1h").
MAX_RETENTION_SECONDS = 3600.0


@dataclass(frozen=True, slots=True)
class CacheRetention:
    """Keep the KV of a prompt's first `tokens` tokens ahead of unmarked prefixes under eviction
    pressure for `seconds` (a client's cache breakpoint and its TTL; docs/prompt-caching.md).

    Protocol-neutral: the API layer derives it from whatever the client marked. It orders
    eviction and never pins memory, so any valid value is safe for the engine."""

    tokens: int
    seconds: float

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError unless tokens is an integer >= 0 and seconds a number in [0, 3600].
        The engine calls it again on what reaches it (an unpickled message skips __init__)."""
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"cache retention tokens must be an integer >= 0, got {self.tokens!r}")
        seconds = self.seconds
        if (isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds)
                or not 0 <= seconds <= MAX_RETENTION_SECONDS):
            raise ValueError(f"cache retention seconds must be in [0, {MAX_RETENTION_SECONDS:.0f}], got {seconds!r}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Blocks allocated, their KV arriving from elsewhere (a KV connector's asynchronous
    # load); the engine steps the others meanwhile.
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass
class Request:
    """One sequence as the scheduler sees it: token ids and how far the KV cache has got.

    `num_computed_tokens` is the single progress counter the scheduler moves toward
    `num_tokens` (prompt + generated); prefill chunks and decode steps are the same thing.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    # Prefix-cache hit seen when the request was queued: what load reports count as already
    # computed while it waits (admission finds the real hit, which may have changed since).
    expected_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Chain hashes of the full blocks of `all_token_ids`, computed once when the request
    # arrives and extended as blocks fill (KVCacheManager.update_block_hashes). Every
    # consumer (prefix cache, KV connectors, handoffs) reads them from here.
    block_hashes: list[int] = field(default_factory=list)
    cache_salt: str | None = None  # isolates a tenant's cache: the chain's root is salted
    retention: CacheRetention | None = None  # keep its prompt's marked prefix ahead of others
    # A KV connector's instructions for this request (e.g. the prefill/decode handoff).
    kv_transfer_params: dict[str, Any] | None = None
    # Guesses a worker-side proposer (a draft model) made after the last step, to verify next.
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int | None = None


@dataclass(slots=True)
class SampledToken:
    """What the sampler produced for one request in one step."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[list[TokenLogprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    queue_seconds: float | None = None  # arrival to first scheduling


@dataclass
class EngineLoad:
    """What a router or an admission check needs to know about an engine, in tokens and blocks.

    Counted in sequences (n > 1 fans a request out into n of them) because that is what the
    scheduler runs and what occupies KV blocks.
    """

    num_waiting: int = 0
    num_running: int = 0
    waiting_prefill_tokens: int = 0  # prompt tokens not yet computed, waiting and running
    running_kv_tokens: int = 0  # tokens held in the KV cache by running sequences
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_cached: int = 0  # blocks holding a hashed, reusable prefix (in use or free)
    kv_blocks_retained: int = 0  # of which kept ahead of others by a cache breakpoint, now
    prefix_cache_queries: int = 0  # prompt tokens looked up, cumulative
    prefix_cache_hits: int = 0  # of which found cached, cumulative
    connector_loaded_tokens: int = 0  # prompt tokens a connector loaded (handoff, KV tiers), cumulative
    num_preemptions: int = 0  # cumulative
    # Each running KV connector's counters under its config section (the registry's key:
    # tandem/kvcache/connector/factory.py), e.g. "kv_transfer" for the prefill/decode handoff,
    # "kv_tiers" for the CPU, disk and cluster tiers; a connector that is off is absent.
    connectors: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Speculative decoding's counters (tandem/spec/stats.py `as_dict`); empty when it is off.
    spec_decode: dict[str, Any] = field(default_factory=dict)
    # Structured outputs' counters (tandem/structured/constraints.py ConstraintStats); empty
    # before the first constrained request.
    structured: dict[str, Any] = field(default_factory=dict)

    def connector(self, section: str) -> dict[str, Any]:
        """One connector's counters; empty when it is off."""
        return self.connectors.get(section, {})

    @property
    def kv_held(self) -> int:
        """KV kept leased to others (a prefill worker's handoffs), over every connector."""
        return sum(int(counters.get("held", 0)) for counters in self.connectors.values())

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
