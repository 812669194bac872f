"""What crosses the line between the scheduler and the workers each step, as plain data.

The scheduler runs in the engine core; model runners may run in other processes or on other
ranks. So nothing live crosses: a `SchedulerOutput` names requests by id and carries only
what changed since the runner last saw each one, and a `ModelRunnerOutput` carries back the
sampled tokens. Both pickle small and in time independent of sequence length, except a
request's first appearance (and its re-appearance after a preemption), which carries its
tokens once. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.kvcache.connector.base import KVConnectorOutput
from tandem.types import SampledToken, SamplingParams

if TYPE_CHECKING:  # numpy: only a constrained step carries masks
    from tandem.structured.masks import PendingMasks


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: everything it needs, once."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before: elsewhere (a prefill worker) or before a preemption
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]
    num_computed_tokens: int  # where this step's chunk starts


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: only what changed since its last step."""

    request_id: str
    new_token_ids: list[int]  # appended since (the token sampled last step)
    new_block_ids: list[int]  # allocated since
    num_computed_tokens: int  # where this step's chunk starts


@dataclass(slots=True)
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens this step
    # Requests the runner should forget: finished or aborted since the last step...
    finished_request_ids: list[str] = field(default_factory=list)
    # ...and preempted this step (they come back as new requests, recomputed).
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests whose last step failed (engine_core.py): the runner drops what it holds for them
    # and is sent them whole again when they next run; their KV blocks stay theirs.
    reset_request_ids: list[str] = field(default_factory=list)
    kv_connector_metadata: Any = None  # the KV connectors' per-step instructions to their worker sides
    # Draft tokens to verify, per request: the last len(drafts) of its scheduled tokens.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Guesses a worker-side proposer (draft model) should make for each request after this step.
    draft_lookahead: dict[str, int] = field(default_factory=dict)
    # Grammar-constrained requests' token masks (tandem/structured/masks.py), one row per token
    # they sample this step; still being filled while the forward runs. None: no constraint.
    token_masks: PendingMasks | None = None
    # Asynchronous scheduling: requests whose one scheduled token is the one the step before
    # this samples, not known on the host yet; the runner takes it from that step's samples on
    # the device.
    last_step_inputs: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def empty(self) -> bool:
        """No model forward this step (connector work may still be due)."""
        return not self.num_scheduled_tokens


@dataclass(slots=True)
class ModelRunnerOutput:
    # request id -> its new tokens: one, or with drafts verified, the accepted drafts and the
    # target's own token after them.
    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    # A worker-side proposer's guesses for each sampling request's next step (draft model).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_seconds: float = 0.0  # the draft model's share of the step
    draft_forward_seconds: float = 0.0  # one single-token forward of the draft over the batch
    kv_connector_output: KVConnectorOutput | None = None  # None: no KV connector is configured
    # Asynchronous scheduling, in the worker's own process only: the step's sampled tokens are
    # still on their way from the device; `resolve` waits for them and fills `sampled`.
    pending_sampled: Callable[[], dict[str, list[SampledToken]]] | None = None

    def resolve(self) -> ModelRunnerOutput:
        """This output with its sampled tokens on the host (waiting for the device if need be)."""
        if self.pending_sampled is not None:
            self.sampled = self.pending_sampled()
            self.pending_sampled = None
        return self
