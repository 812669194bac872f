"""Which layout to run: every split of up to N workers into prefill / decode pools, and every
colocated count, simulated on the same traffic; the smallest that meets the SLOs wins.

The question DistServe's placement search and Dynamo's planner answer: a prefill pool takes
long prompts off the decode workers, so decode steps stay short (time per output token),
at the price of a KV handoff and of workers that sit idle when the mix turns output-heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.plan.pools.costs import CostModel
from tandem.plan.pools.simulator import EngineLimits, Layout, SimResult, simulate
from tandem.plan.pools.traffic import SimWorkload


@dataclass(frozen=True)
class Slo:
    ttft_p90_s: float
    tpot_p90_s: float


@dataclass
class Candidate:
    layout: Layout
    result: SimResult
    slo: Slo

    @property
    def ttft_p90_s(self) -> float:
        return self.result.ttft(90)

    @property
    def tpot_p90_s(self) -> float:
        return self.result.tpot(90)

    @property
    def headroom(self) -> float:
        """The smaller of the two SLO margins (1.0: at the limit; above: to spare)."""
        tpot = self.tpot_p90_s
        tpot_margin = self.slo.tpot_p90_s / tpot if tpot == tpot and tpot > 0 else float("inf")
        return min(self.slo.ttft_p90_s / max(self.ttft_p90_s, 1e-9), tpot_margin)

    @property
    def meets(self) -> bool:
        return self.headroom >= 1.0


def layouts(max_workers: int) -> list[Layout]:
    """Colocated 1..N, and P prefill + D decode for every P, D >= 1 with P + D <= N."""
    if max_workers < 1:
        raise ValueError(f"--max-workers must be >= 1, got {max_workers}")
    out = [Layout(colocated=n) for n in range(1, max_workers + 1)]
    out += [Layout(prefill=p, decode=d) for total in range(2, max_workers + 1)
            for p in range(1, total) for d in [total - p]]
    return out


def search(workload: SimWorkload, costs: CostModel, slo: Slo, max_workers: int,
           limits: EngineLimits | None = None, pd_min_prompt_tokens: int = 256) -> list[Candidate]:
    """Every layout simulated, best first: those meeting the SLOs by fewest workers (then by
    headroom), then the rest by headroom."""
    candidates = [Candidate(layout, simulate(workload, layout, costs, limits, pd_min_prompt_tokens), slo)
                  for layout in layouts(max_workers)]
    return sorted(candidates, key=lambda c: (not c.meets, c.layout.workers if c.meets else 0, -c.headroom))


def recommendation(ranked: list[Candidate]) -> str:
    best = ranked[0]
    if not best.meets:
        return (f"no layout of up to {max(c.layout.workers for c in ranked)} workers meets the SLOs; "
                f"closest: {best.layout.describe()} (TTFT p90 {best.ttft_p90_s:.3f} s, "
                f"TPOT p90 {best.tpot_p90_s * 1e3:.1f} ms)")
    same_size = [c for c in ranked if c.meets and c.layout.workers == best.layout.workers]
    other = next((c for c in same_size if c.layout.disaggregated != best.layout.disaggregated), None)
    verdict = "disaggregate" if best.layout.disaggregated else "do not disaggregate"
    line = (f"{verdict}: {best.layout.describe()} ({best.layout.workers} workers) meets the SLOs with "
            f"{best.headroom:.2f}x headroom")
    if other is not None:
        line += f"; {other.layout.describe()} also does, with {other.headroom:.2f}x"
    return line
