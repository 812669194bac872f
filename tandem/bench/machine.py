"""What this machine can do at best, measured on the spot: a matmul rate and a memory copy
rate. Benches print their figures against these ceilings, so a ratio between two engines
also shows how far both are from the hardware."""

from __future__ import annotations

import time


def memory_copy_bytes_per_s(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes per second of a large tensor copy (each byte read once and written once)."""
    import torch

    big = torch.empty(nbytes, dtype=torch.uint8)
    big.fill_(1)
    out = torch.empty_like(big)
    out.copy_(big)
    started = time.perf_counter()
    for _ in range(repeats):
        out.copy_(big)
    return repeats * nbytes / (time.perf_counter() - started)


def memory_read_bytes_per_s(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second of reading a large fp32 tensor (a sum), with torch's threads: what a
    one-token step, which reads every weight once, is bound by. Filled first, so the pages
    are real memory rather than the shared zero page."""
    import torch

    big = torch.ones(nbytes // 4, dtype=torch.float32)
    big.sum()
    started = time.perf_counter()
    for _ in range(repeats):
        big.sum()
    return repeats * nbytes / (time.perf_counter() - started)


def matmul_flops_per_s(dtype: str = "float32", m: int = 2048, k: int = 576, n: int = 1536, repeats: int = 5) -> float:
    """FLOP/s of a [m, k] x [k, n] matmul in `dtype` with torch's threads."""
    import torch

    a = torch.randn(m, k).to(getattr(torch, dtype))
    b = torch.randn(k, n).to(getattr(torch, dtype))
    torch.mm(a, b)
    started = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    return repeats * 2 * m * k * n / (time.perf_counter() - started)
