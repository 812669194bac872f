"""One expert-parallel rank of tests/distributed/test_expert_parallel.py, run as a script.

Joins a gloo group, builds its share of a FusedMoE from the whole weights in CASE (a file the
test wrote: the MoeConfig's fields, the hidden size, the router, every expert's gate/up/down,
the shared experts, the inputs), loading each expert through `load_expert` by its global
index; another rank's experts are offered as an object that fails the test if touched. Runs
the layer on every input (one under the profiler) and saves the outputs and what it holds.

Once its results are saved and the process group is destroyed, the rank leaves with
`os._exit(0)`, skipping torch's teardown at interpreter exit. Twice in CI (2026-12-02, a loaded
2-core box) a rank aborted after the profiler's stop with "terminate called without an active
exception" and no Python error: the mark of a C++ thread object destroyed while still running,
which is what static teardown of the profiler's and gloo's threads can do; it never happened
in 130 runs here. faulthandler stays on so an abort before that point prints every thread's
Python stack, and the test says which ranks had saved their results.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.config import MoeConfig
from tandem.distributed.expert_parallel import ExpertParallel
from tandem.distributed.tensor_parallel import TensorParallel
from tandem.layers.moe import FusedMoE

PHASES = ("moe.route", "moe.dispatch", "moe.experts", "moe.combine", "moe.gather")


class Untouchable:
    """Stands in for another rank's expert tensor: any use of it is a failure."""

    touched = False

    def __getattr__(self, name: str):
        Untouchable.touched = True
        raise AssertionError(f"a non-local expert's tensor was read ({name})")


def main(rank: int, world: int, port: int, case: str, out: str) -> None:
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    data = torch.load(case)
    config = MoeConfig(**data["config"])
    # as a model would build it: its tensor-parallel place and the expert-parallel one
    moe = FusedMoE(config, data["hidden"], TensorParallel(rank, world), ExpertParallel(rank, world))
    moe.gate.data.copy_(data["gate"])
    if moe.correction_bias is not None:
        moe.correction_bias.data.copy_(data["correction_bias"])
    for expert, projections in enumerate(data["experts"]):
        for projection, tensor in projections.items():
            moe.load_expert(expert, projection, tensor if moe.owns_expert(expert) else Untouchable())
    if moe.shared_experts is not None:
        moe.shared_experts.gate_up_proj.load("weight", data["shared"]["gate"], 0)
        moe.shared_experts.gate_up_proj.load("weight", data["shared"]["up"], 1)
        moe.shared_experts.down_proj.load("weight", data["shared"]["down"])

    with torch.inference_mode():
        outputs = [moe(x) for x in data["inputs"]]
        with_residual = moe(data["inputs"][-1], data["residual"])
        with torch.profiler.profile() as profiler:
            moe(data["inputs"][-1])
    phases = sorted({event.key for event in profiler.key_averages() if event.key in PHASES})
    held = {name: p.numel() for name, p in moe.named_parameters()}
    torch.save({"outputs": outputs, "with_residual": with_residual, "held": held, "phases": phases,
                "local": (moe.local_expert_range.start, len(moe.local_expert_range)),
                "w13": moe.w13.data.clone(), "w2": moe.w2.data.clone(), "touched": Untouchable.touched}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    rank, world, port = (int(a) for a in sys.argv[1:4])
    main(rank, world, port, sys.argv[4], sys.argv[5])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
