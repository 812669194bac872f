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


def test_the_mapping_is_private_memory_not_shmem() -> None:
    """A shared anonymous mapping is shmem, whose first writes cost more (lazy_memory.py)."""
    tensor = lazily_zeroed((64, 1 << 16), torch.float32)
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(part, 16) for part in span.split("-"))
            if start <= address < end:
                assert perms == "rw-p", line
                return
    raise AssertionError("the tensor's mapping is not in /proc/self/maps")
