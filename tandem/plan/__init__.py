"""Capacity planning from a model's config.json, without its weights (`tandem plan`).

A tool on top of `tandem.sizing` (the memory model the runtime also sizes itself with): the
`tandem plan` commands, the printed report, and the prefill/decode pool planner (`pools`).
torch-free on purpose: a plan for a 1T-parameter model must run on a laptop or a router box.

    from tandem.plan import PlanRequest, plan_memory, format_memory_plan
    plan = plan_memory(config_dict, PlanRequest(parse_devices("8xH200"), Parallel(tp=8)))
    print(format_memory_plan(plan))
"""

from __future__ import annotations

from tandem.plan.report import format_memory_plan, plan_to_dict
from tandem.sizing.devices import Devices, parse_devices
from tandem.sizing.errors import PlanError
from tandem.sizing.memory import EnginePlan, MemoryPlan, PlanRequest, StagePlan, plan_memory
from tandem.sizing.sharding import Parallel

__all__ = [
    "Devices",
    "EnginePlan",
    "MemoryPlan",
    "Parallel",
    "PlanError",
    "PlanRequest",
    "StagePlan",
    "format_memory_plan",
    "parse_devices",
    "plan_memory",
    "plan_to_dict",
]
