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
