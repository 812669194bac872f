"""The step's named phases under a real profiler: a real model step, profiled on its rank."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tandem.platform.profiling import PHASES


def test_a_profiled_run_partitions_each_step_into_its_phases() -> None:
    with LLM(kv_cache_memory="64MiB", num_threads=1) as llm:
        core = llm.engine.core
        core.collective_rpc("start_profile")
        llm.generate(["The capital of France is"], SamplingParams(max_tokens=5, temperature=0))
        (breakdown,) = core.collective_rpc("stop_profile")
    assert breakdown["steps"] == 5  # one prefill, four decodes
    parts = sum(breakdown[p] for p in PHASES) + breakdown["other"]
    assert parts == pytest.approx(breakdown["step"], rel=1e-6)
    assert 0 < breakdown["attention"] < breakdown["step"]
    assert breakdown["moe.experts"] == 0 and breakdown["tp.all_reduce"] == 0  # a dense model on one rank
