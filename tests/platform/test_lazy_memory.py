"""The KV cache allocation: zero, writable, and resident only where written."""

from __future__ import annotations

import psutil
import torch

from tandem.platform.lazy_memory import lazily_zeroed


def test_lazily_zeroed_is_zero_and_writable() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        tensor = lazily_zeroed((3, 4, 5), dtype)
        assert tensor.dtype == dtype and tensor.shape == (3, 4, 5) and tensor.is_contiguous()
        assert not tensor.any()
        tensor[1, 2, 3] = 7
        assert tensor.sum() == 7


def test_large_budget_costs_no_memory_until_used() -> None:
    process = psutil.Process()
    before = process.memory_info().rss
    tensor = lazily_zeroed((256, 1 << 20), torch.float32)  # 1 GiB
    assert process.memory_info().rss - before < 64 << 20
    tensor[:4].fill_(1.0)  # touch 16 MiB
    assert process.memory_info().rss - before >= 16 << 20
