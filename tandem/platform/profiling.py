"""Named ranges of a step for the profiler: where a step's time goes, by phase.

The model marks its phases (attention, MoE routing / dispatch / experts / combine, the
tensor-parallel all-reduces, the pipeline's sends and receives, the whole step) with
`profiled(name)`. While a torch profiler runs (`tandem bench offline --profile`, through
`Worker.start_profile`), each is a `record_function` range and `step_breakdown` sums them; the
rest of the time an idle `record_function` would still cost ~4 us per range, so then it is a
no-op costing a flag check.
"""

from __future__ import annotations

import contextlib

import torch

_NO_RANGE = contextlib.nullcontext()

# The ranges, and how a report groups them. Nested ranges are not double counted: the MoE
# phases and the all-reduces sit inside "step", never inside each other or "attention",
# except the attention's own o_proj all-reduce, which `step_breakdown` moves out of it.
STEP = "step"
PHASES = ("attention", "moe.route", "moe.experts", "moe.dispatch", "moe.combine", "moe.gather",
          "tp.all_reduce", "tp.all_gather", "pp.send", "pp.recv")


def profiled(name: str) -> contextlib.AbstractContextManager:
    """A profiler range named `name` while a profiler runs; nothing otherwise."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else _NO_RANGE


def step_breakdown(events: list) -> dict[str, float]:
    """Milliseconds per phase over the profiled steps, as a partition of the step time: each
    range counts its time minus the labelled ranges nested inside it (an all-reduce inside
    attention counts as all-reduce), and "step" keeps what no phase claimed ("other").
    `events`: a torch profiler's FunctionEvents. Also returns "steps", the steps seen."""
    labels = {STEP, *PHASES}

    def nested_labelled(event: object) -> float:
        total = 0.0
        for child in event.cpu_children:  # type: ignore[attr-defined]
            total += child.cpu_time_total if child.name in labels else nested_labelled(child)
        return total

    breakdown = dict.fromkeys((*PHASES, "other"), 0.0)
    breakdown["step"] = 0.0
    steps = 0
    for event in events:
        if event.name not in labels:
            continue
        own = (event.cpu_time_total - nested_labelled(event)) / 1000
        if event.name == STEP:
            steps += 1
            breakdown["step"] += event.cpu_time_total / 1000
            breakdown["other"] += own
        else:
            breakdown[event.name] += own
    breakdown["steps"] = steps
    return breakdown
