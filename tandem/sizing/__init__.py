"""How much memory a model takes where it runs, from its config.json alone (no weights, no GPU).

The one reader of a checkpoint's shapes (`shape.read_shape`) and the memory model built on it:
weights per rank under tensor, pipeline and expert parallelism (`sharding`, `tensors`), the
activation peak of one step (`activation`), KV bytes per token (`kv`), devices and their
overheads (`devices`), and the whole split with the KV tokens that fit (`memory`). The worker
sizes its KV cache from it, the engine logs it beside what the ranks measured, and the
`tandem plan` tool prints it: the runtime imports this package, never the planner.

torch-free on purpose: a plan for a 1T-parameter model must run on a laptop or a router box.
This file imports nothing, so `tandem.config` can share `experts.expert_layout` without a cycle;
import the module you need.
"""
