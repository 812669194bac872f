"""The plain messages between an API server and its engine core process (pickled over ZMQ).

Requests go in as token ids; what comes out each step is only what changed (per-step deltas:
new token ids, their logprobs, a finish reason), so a message's size does not grow with the
length of the sequence. The server owns the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.types import CacheRetention, EngineLoad, SamplingParams, TokenLogprob


# --- server -> core ----------------------------------------------------------------------
@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prior_output_ids: list[int] | None = None  # generated elsewhere (a prefill worker's first token)
    kv_transfer_params: dict[str, Any] | None = None  # for the KV connectors (the PD handoff)
    cache_salt: str | None = None
    retention: CacheRetention | None = None  # keep the prompt's marked prefix cached ahead of others


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class FinishSequence:
    """A stop string was found in the text of one sequence: stop computing it."""

    request_id: str
    index: int


@dataclass
class ResetPrefixCache:
    pass


@dataclass
class ReleaseTransfer:
    """The server decided nobody will fetch these held blocks (the output ended at once)."""

    transfer_id: str


@dataclass
class Shutdown:
    pass


# --- core -> server ----------------------------------------------------------------------
@dataclass
class EngineInfo:
    """Sent once when the engine is ready: what the server needs to serve it."""

    model_name: str
    hf_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    num_blocks: int
    startup_seconds: float
    pid: int
    root_hash: int = 0  # of the block-hash chain (kvcache/block_hash.py), for routers hashing prompts
    fingerprint: str = ""  # the model's, which the root hash is made of
    role: str = "both"
    kv_source: str | None = None  # tcp://host:port of this worker's KV source
    world_size: int = 1


@dataclass
class CoreFailed:
    message: str


@dataclass(slots=True)
class SequenceDelta:
    index: int
    token_ids: list[int]
    logprobs: list[list[TokenLogprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class RequestDelta:
    """New tokens of one request since the last delta, per sequence."""

    request_id: str
    sequences: list[SequenceDelta]
    finished: bool
    num_cached_tokens: int
    queue_seconds: float | None = None  # arrival to first scheduling; on the first delta only
    error: str | None = None  # the core refused the request (the server validates first)
    kv_transfer_params: dict[str, Any] | None = None  # a connector's word on the request's KV, at its end
    num_loaded_tokens: int = 0  # on the first delta: prompt tokens whose KV a connector supplied


@dataclass(slots=True)
class CoreOutputs:
    deltas: list[RequestDelta] = field(default_factory=list)
    load: EngineLoad | None = None
    reset_prefix_cache: bool | None = None
    # ("stored" / "removed" / "cleared", block hash[, medium]): the block pool's (device), then the
    # connectors' (cpu, disk, cluster tiers), in order
    kv_events: list[tuple] = field(default_factory=list)
