"""The proposer seam: something cheap guesses a request's next k tokens.

The target model verifies the guesses inside the normal engine step (the k tokens are extra
tokens of the request under the same token budget) and keeps the longest prefix it agrees
with, so a proposer only changes speed, never output. A proposer that reads nothing but
token ids (n-gram prompt lookup, suffix trees) is a `TokenProposer` and runs in the engine
core beside the scheduler: no tensors, no torch, one copy whatever the number of ranks.
Proposers that run a model (a draft model, EAGLE heads) live on the worker instead, next to
the weights they need.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class TokenProposer(ABC):
    """Proposes from token ids alone. Torch-free; called once per request per step."""

    name: str = ""

    @abstractmethod
    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                max_tokens: int) -> list[int]:
        """Up to `max_tokens` guesses for what follows `token_ids` (the request's prompt and
        output so far, the token just sampled last); [] when there is no good guess.

        Called every step a request decodes, with the same growing sequence, so a proposer
        that indexes a request's tokens may index only what is new since the last call."""

    def request_finished(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:  # noqa: B027
        """The request ended (finished, aborted or preempted for good): drop its state, or
        keep what it generated to propose for later requests."""
