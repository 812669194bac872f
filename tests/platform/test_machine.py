"""The box's measured matmul rate, the ceiling every bench line's share is taken of."""

from __future__ import annotations

import pytest
import torch

from tandem.platform import machine


def test_the_rate_is_the_faster_of_torch_mm_and_onednn_s_packed_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an AMD EPYC torch.mm's fp32 (MKL) ran at half of oneDNN's packed linear, which the
    engines' linears call: a ceiling from torch.mm alone read above 100% reached."""
    monkeypatch.setattr(machine, "_onednn_packed_rate", lambda *args: 1e18)
    assert machine.matmul_flops_per_s("float32", 64, 64, 64, repeats=1) == 1e18
    monkeypatch.setattr(machine, "_onednn_packed_rate", lambda *args: 0.0)
    assert 0 < machine.matmul_flops_per_s("float32", 64, 64, 64, repeats=1) < 1e18


def test_onednn_s_packed_linear_is_timed_where_this_torch_has_it() -> None:
    a, b = torch.randn(64, 96), torch.randn(96, 80)
    assert machine._onednn_packed_rate(a, b, 1) > 0
    bf16 = machine._onednn_packed_rate(a.bfloat16(), b.bfloat16(), 1)
    assert (bf16 > 0) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_a_rate_is_its_fastest_call_not_the_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ceiling is the machine at its best: one slow call (another process, a page-in) must not
    pull it down, as the mean of the calls did (13.2 against 24.2 GB/s read in two runs on one
    box). A scripted clock: the calls take 4, 1 and 4 seconds after an untimed one."""
    durations = iter([4.0, 1.0, 4.0])
    clock = {"now": 0.0}

    class Clock:
        @staticmethod
        def perf_counter() -> float:
            return clock["now"]

    def work() -> None:
        clock["now"] += next(durations, 0.0) if calls else 0.0
        calls.append(1)

    calls: list[int] = []
    monkeypatch.setattr(machine, "time", Clock)
    assert machine.best_rate(work, 100, repeats=3) == 100.0
    assert len(calls) == 4
