"""Pool planning (`tandem plan profile`, `tandem plan pools`): how many prefill and decode
workers a traffic mix needs to meet its latency goals, and whether to split them at all.

A discrete-event simulation of the cluster (router, prefill and decode pools, chunked
prefill, the prefix cache, the KV handoff), driven by step costs measured from the engine on
the target machine. Torch-free: only `profile.measure_profile` loads a model.
"""

from tandem.plan.pools.costs import CostModel, StepShape
from tandem.plan.pools.simulator import Layout, SimResult, simulate
from tandem.plan.pools.traffic import SimRequest, TrafficMix

__all__ = ["CostModel", "Layout", "SimRequest", "SimResult", "StepShape", "TrafficMix", "simulate"]
