"""Replay a token proposer over recorded greedy answers: verification steps in seconds, not minutes.

For greedy decoding the engine's output does not depend on the proposer, and a verification
step with drafts d keeps the longest prefix of d that equals the true continuation plus the
target's own token after it. So given each request's prompt and its greedy answer, the number
of target steps a proposer needs is known without running the model: the steps ratio
(baseline steps / speculative steps) that `tandem bench spec` measures as "steps x". At
batch 1 a step costs about the same whatever its few extra tokens (the weights are read once
per step), so that ratio is most of the speedup; `predicted_speedup` adds the per-token cost.

Requests are replayed one after another on one proposer, as a batch-1 cell of the bench runs
them (so a proposer that keeps finished requests' outputs, suffix decoding's global tree,
sees the cell's earlier answers and no others). The step that computes the prompt carries
no drafts (the scheduler admits a new request after it has handed out drafts to the running
ones; the bench's prompts take one step), and a request may take at most
`max_tokens - outputs so far - 1` drafts, as in the scheduler. Fixed k verifies every draft
up to k; adaptive k runs the engine's own rule (tandem/spec/adaptive.py) on a step cost of
`1 + cost_ratio x tokens`.

    python -m tandem.bench.spec_replay OUTPUTS.jsonl [--methods ngram,suffix] [--ks 4,8,16]

reads the baseline answers (and their prompts) from the outputs.jsonl `tandem bench spec`
writes. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tandem.spec.adaptive import AcceptanceTracker, StepCostModel, choose_lookahead
from tandem.spec.proposer import TokenProposer


@dataclass(frozen=True)
class Recorded:
    """One request: its prompt's token ids and its greedy answer's (a stop token included)."""

    prompt: Sequence[int]
    output: Sequence[int]


@dataclass
class ReplayStats:
    """What a replay counted; `steps` are target steps (the prompt's included)."""

    requests: int = 0
    output_tokens: int = 0
    steps: int = 0
    drafted_steps: int = 0  # steps that verified at least one draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verified_tokens: int = 0  # drafts verified + one per step: what the steps computed besides the prompt
    propose_calls: int = 0
    propose_seconds: float = 0.0
    step_sizes: dict[int, int] = field(default_factory=dict)  # tokens a step verified -> steps

    @property
    def steps_ratio(self) -> float:
        """Baseline steps (one per output token) over speculative steps."""
        return self.output_tokens / self.steps if self.steps else 0.0

    @property
    def drafted_share(self) -> float:
        return self.drafted_steps / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens per drafted verification, the target's own included (vLLM's definition)."""
        return 1.0 + self.accepted_tokens / self.drafted_steps if self.drafted_steps else 0.0

    @property
    def mean_k(self) -> float:
        return self.draft_tokens / self.drafted_steps if self.drafted_steps else 0.0

    @property
    def propose_us(self) -> float:
        return 1e6 * self.propose_seconds / self.propose_calls if self.propose_calls else 0.0

    def predicted_speedup(self, cost: float | Callable[[int], float]) -> float:
        """Baseline time / speculative time when a step over t tokens costs `cost(t)`, or
        1 + cost x t for a number (the engine's linear model). The step that computes the
        prompt is counted as one of t tokens: the prompt's cost is the same on both sides
        and left out."""
        step_cost = cost if callable(cost) else (lambda t: 1.0 + cost * t)
        spec = sum(n * step_cost(t) for t, n in self.step_sizes.items())
        return self.output_tokens * step_cost(1) / spec if spec else 0.0

    def add(self, other: ReplayStats) -> None:
        """Sum another replay's counts into this one (cells of one configuration)."""
        for name in self.__dataclass_fields__:
            if name == "step_sizes":
                for size, n in other.step_sizes.items():
                    self.step_sizes[size] = self.step_sizes.get(size, 0) + n
            else:
                setattr(self, name, getattr(self, name) + getattr(other, name))


def common_prefix(drafts: Sequence[int], truth: Sequence[int]) -> int:
    n = 0
    for guess, token in zip(drafts, truth, strict=False):  # the answer may end first
        if guess != token:
            break
        n += 1
    return n


def replay(proposer: TokenProposer, requests: Iterable[Recorded], k: int, adaptive: bool = False,
           max_tokens: int = 128, cost_ratio: float = 0.01, timed: bool = False) -> ReplayStats:
    """Steps `proposer` needs for `requests`, one after another, verifying at most `k` drafts
    per step (all of them with fixed k; the engine's adaptive rule's choice with `adaptive`)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    stats = ReplayStats()
    tracker = AcceptanceTracker()
    cost = StepCostModel()
    clock = time.perf_counter
    for index, request in enumerate(requests):
        request_id = f"replay-{index}"
        prompt, output = list(request.prompt), list(request.output)
        tokens = list(prompt)
        done = 0
        stats.requests += 1
        stats.output_tokens += len(output)
        while done < len(output):
            cap = min(k, max_tokens - done - 1) if done else 0  # the prompt's step: none
            drafts: list[int] = []
            if cap > 0:
                started = clock() if timed else 0.0
                drafts = list(proposer.propose(request_id, tokens, len(prompt), cap))[:cap]
                if timed:
                    stats.propose_seconds += clock() - started
                    stats.propose_calls += 1
            if drafts and adaptive:
                chosen = choose_lookahead({request_id: tracker.rate(request_id)}, {request_id: len(drafts)},
                                          1, 1, cost, 1 << 30)
                keep = chosen.get(request_id, 0)
                if not keep:
                    tracker.passed_over(request_id)
                    tracker.nobody_tried()
                drafts = drafts[:keep]
            accepted = common_prefix(drafts, output[done:])
            kept = min(accepted + 1, len(output) - done)  # a stop among the drafts ends the request
            stats.steps += 1
            stats.verified_tokens += len(drafts) + 1
            stats.step_sizes[len(drafts) + 1] = stats.step_sizes.get(len(drafts) + 1, 0) + 1
            if drafts:
                stats.drafted_steps += 1
                stats.draft_tokens += len(drafts)
                stats.accepted_tokens += kept - 1
                tracker.observe(request_id, len(drafts), kept - 1)
            cost.observe(len(drafts) + 1, 1.0 + cost_ratio * (len(drafts) + 1))
            tokens += output[done:done + kept]
            done += kept
        proposer.request_finished(request_id, tokens, len(prompt))
        tracker.forget(request_id)
    return stats


# --- the command ------------------------------------------------------------------------------


def read_outputs(path: Path, kind: str | None = None) -> dict[str, list[Recorded]]:
    """The baseline's answers with their prompts, per kind, from a bench's outputs.jsonl
    (batch-1 cells; the first cell of each kind wins)."""
    found: dict[str, list[Recorded]] = {}
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            if row.get("label") != "baseline" or row.get("batch") != 1 or (kind and row["kind"] != kind):
                continue
            prompts = row.get("prompt_token_ids")
            if prompts is None:
                raise ValueError(f"{path}: no prompt_token_ids (written by an older tandem bench spec)")
            if row["kind"] not in found:
                found[row["kind"]] = [Recorded(p, o) for p, o in zip(prompts, row["outputs"], strict=True)]
    return found


def make_proposer(method: str, k: int) -> Callable[[], TokenProposer]:
    """A factory of fresh proposers of `method` with the engine's defaults (bench cells start
    each from nothing)."""
    from tandem.config import SpeculativeConfig
    from tandem.spec.factory import make_token_proposer

    config = SpeculativeConfig(method=method, num_speculative_tokens=k)
    return lambda: make_token_proposer(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.spec_replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outputs", type=Path, help="outputs.jsonl of a tandem bench spec run")
    parser.add_argument("--methods", default="ngram,suffix")
    parser.add_argument("--ks", default="4,8,16")
    parser.add_argument("--no-adaptive", dest="adaptive", action="store_false")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--cost-ratio", type=float, default=0.01,
                        help="cost of a token in a step / a step's fixed cost (default 0.01: batch 1 here)")
    args = parser.parse_args(argv)
    by_kind = read_outputs(args.outputs)
    if not by_kind:
        print(f"{args.outputs}: no batch-1 baseline answers", file=sys.stderr)
        return 1
    ks = [int(k) for k in args.ks.split(",") if k]
    print(f"{'kind':6} {'config':20} {'steps x':>8} {'pred x':>7} {'drafting':>8} {'acc len':>8} {'k mean':>7} "
          f"{'us/call':>8}")  # drafting: the share of steps that verified a draft
    for kind, requests in by_kind.items():
        for method in args.methods.split(","):
            configs = [(k, False) for k in ks] + ([(max(ks), True)] if args.adaptive else [])
            for k, adaptive in configs:
                stats = replay(make_proposer(method, k)(), requests, k, adaptive, args.max_tokens,
                               args.cost_ratio, timed=True)
                name = f"{method} {'adaptive<=' if adaptive else 'k='}{k}"
                print(f"{kind:6} {name:20} {stats.steps_ratio:7.2f}x {stats.predicted_speedup(args.cost_ratio):6.2f}x "
                      f"{stats.drafted_share:7.0%} {stats.acceptance_length:8.2f} {stats.mean_k:7.1f} "
                      f"{stats.propose_us:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
