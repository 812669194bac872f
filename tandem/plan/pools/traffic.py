"""Traffic for the simulator: sessions arriving over time, each a few turns of chat.

A `TrafficMix` describes it as an operator would (session arrival rate, turns per session,
a shared system prefix, new input and output tokens per turn, drawn uniformly); `sample`
draws a concrete `SimWorkload` from it with a seed. Turn k of a session is sent when turn
k-1 has finished, its prompt being everything so far: the system prefix, earlier turns and
their outputs, and the new input. One-turn traffic is a mix with one turn per session.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Chat-template tokens around each message (role markers): the bench's workloads count 8.
MESSAGE_OVERHEAD_TOKENS = 8


@dataclass(frozen=True)
class SimTurn:
    new_tokens: int  # the turn's new input tokens
    output_tokens: int


@dataclass(frozen=True)
class SimSession:
    session_id: str
    arrival_s: float
    turns: tuple[SimTurn, ...]


@dataclass(frozen=True)
class SimWorkload:
    sessions: tuple[SimSession, ...]
    system_tokens: int = 0  # shared by every session's prompts
    message_overhead: int = MESSAGE_OVERHEAD_TOKENS  # 0 for raw completions prompts

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def prompt_tokens(self, session: SimSession, turn: int) -> int:
        """Prompt length of `turn`: the system prefix, the history, the new input."""
        tokens = self.system_tokens + (self.message_overhead if self.system_tokens else 0)
        for earlier in session.turns[:turn]:
            tokens += earlier.new_tokens + earlier.output_tokens + 2 * self.message_overhead
        return tokens + session.turns[turn].new_tokens + self.message_overhead


@dataclass(frozen=True)
class SimRequest:
    """One turn as the simulator sees it."""

    session_id: str
    turn: int
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TrafficMix:
    """Sessions arriving as a Poisson process; per turn, uniform input and output lengths."""

    rate: float  # sessions per second
    num_sessions: int = 64
    turns_min: int = 1
    turns_max: int = 1
    system_tokens: int = 0
    input_min: int = 512
    input_max: int = 512
    output_min: int = 128
    output_max: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 sessions/s, got {self.rate}")
        for name in ("num_sessions", "turns_min", "input_min", "output_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for low, high in (("turns_min", "turns_max"), ("input_min", "input_max"), ("output_min", "output_max")):
            if getattr(self, high) < getattr(self, low):
                raise ValueError(f"{high} ({getattr(self, high)}) < {low} ({getattr(self, low)})")
        if self.system_tokens < 0:
            raise ValueError(f"system_tokens must be >= 0, got {self.system_tokens}")

    def sample(self) -> SimWorkload:
        rng = random.Random(self.seed)
        now, sessions = 0.0, []
        for s in range(self.num_sessions):
            turns = tuple(SimTurn(rng.randint(self.input_min, self.input_max),
                                  rng.randint(self.output_min, self.output_max))
                          for _ in range(rng.randint(self.turns_min, self.turns_max)))
            sessions.append(SimSession(f"s{s}", now, turns))
            now += rng.expovariate(self.rate)
        chat = self.system_tokens > 0 or self.turns_max > 1
        return SimWorkload(tuple(sessions), self.system_tokens, MESSAGE_OVERHEAD_TOKENS if chat else 0)
