"""What this machine is and can do at best: its CPU (name, AVX-512 / AMX flags) and, measured
on the spot, a matmul rate and memory copy and read rates. Benches print their figures against
these ceilings, so a ratio between two engines also shows how far both are from the hardware;
`tandem plan profile` records them beside the step costs it measures. Below both, so the
planner need not import the benches (which import the planner).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def memory_copy_bytes_per_s(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes per second of a large tensor copy (each byte read once and written once)."""
    import torch

    big = torch.empty(nbytes, dtype=torch.uint8)
    big.fill_(1)
    out = torch.empty_like(big)
    out.copy_(big)
    return best_rate(lambda: out.copy_(big), nbytes, repeats)


def memory_read_bytes_per_s(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second of reading a large fp32 tensor (a sum), with torch's threads: what a
    one-token step, which reads every weight once, is bound by. Filled first, so the pages
    are real memory rather than the shared zero page."""
    import torch

    big = torch.ones(nbytes // 4, dtype=torch.float32)
    return best_rate(big.sum, nbytes, repeats)


def matmul_flops_per_s(dtype: str = "float32", m: int = 2048, k: int = 576, n: int = 1536, repeats: int = 5) -> float:
    """FLOP/s of a [m, k] x [k, n] matmul in `dtype` with torch's threads: the faster of
    torch.mm and oneDNN's packed linear (what tandem's and vLLM's CPU linears call). The two
    differ by CPU: on the 2-core AMD EPYC with AVX-512, torch.mm's fp32 (MKL) ran at 230
    GFLOP/s and the packed linear at 540, so a ceiling from torch.mm alone read 126% reached.
    A dtype this CPU has no fast path for (bf16 on an AVX2-only EPYC: ~0.1 GFLOP/s, a 2048^3
    product takes minutes) is measured on a 64-row probe instead of the whole repeated
    product."""
    import torch

    a = torch.randn(m, k).to(getattr(torch, dtype))
    b = torch.randn(k, n).to(getattr(torch, dtype))
    probe_rows = min(m, 64)
    started = time.perf_counter()
    torch.mm(a[:probe_rows], b)
    probe_rate = 2 * probe_rows * k * n / (time.perf_counter() - started)
    if repeats * 2 * m * k * n / probe_rate > 10.0:
        return probe_rate
    return max(best_rate(lambda: torch.mm(a, b), 2 * m * k * n, repeats), _onednn_packed_rate(a, b, repeats))


def best_rate(work: Callable[[], object], amount: int, repeats: int) -> float:
    """`amount` (bytes or FLOPs) over the fastest of `repeats` timed calls, after one untimed.
    A ceiling is what the machine does at its best: the mean of the calls let one slow call
    (another process, a page-in) pull it down, and on the 2-core AMX Xeon two runs of the same
    bench read 13.2 and 24.2 GB/s, which moved a share of the limit from 65% to 79%."""
    work()
    fastest = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        fastest = min(fastest, time.perf_counter() - started)
    return amount / fastest


def _onednn_packed_rate(a: Any, b: Any, repeats: int) -> float:
    """a @ b through oneDNN's packed linear, or 0.0 where this torch or CPU has none for the
    dtype (bf16 without a oneDNN bf16 GEMM)."""
    import torch

    mkldnn = torch.ops.mkldnn
    try:
        if a.dtype == torch.bfloat16 and not mkldnn._is_mkldnn_bf16_supported():
            return 0.0
        packed = mkldnn._reorder_linear_weight(b.t().contiguous(), a.shape[0])
        return best_rate(lambda: mkldnn._linear_pointwise(a, packed, None, "none", [], ""), 2 * a.shape[0] * a.shape[1]
                     * b.shape[1], repeats)
    except (AttributeError, RuntimeError):
        return 0.0


def host_info() -> dict[str, Any]:
    """The CPU's name and its AVX-512 / AMX flags, which decide the GEMM kernels' speed."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpu_count": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and "cpu" not in info:
            info["cpu"] = value.strip()
        if key.strip() == "flags" and "flags" not in info:
            flags = value.split()
            info["flags"] = sorted(f for f in flags if f.startswith(("avx512", "amx")))
    return info
