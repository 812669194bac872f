"""`tandem bench kv-tiers --kv-tier-dtypes`: each tier measured per chunk dtype, its bytes per
token set beside bf16's with the issue's goals (int8 <= 0.55x, int4 <= 0.3x); a dtype the
server does not take is refused before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.bench.kv_tiers import TierResult, report, tier_dtypes

LIMITS = {"kv_bytes": 1e8, "ideal_load_s": 0.01, "memcpy_bytes_per_s": 1e10, "ideal_prefill_s": 1.0,
          "matmul_flops_per_s": 7e10, "bf16_bytes_per_token": 23040.0}


def _result(tier: str, dtype: str, ttft: float, block_bytes: int | None) -> TierResult:
    return TierResult(tier, ttft_s=[ttft], cached_tokens=[4096], prompt_tokens=[4104], dtype=dtype,
                      block_bytes=block_bytes, block_size=16)


def test_each_dtype_is_a_row_with_its_bytes_beside_bf16s() -> None:
    results = [_result("recompute", "auto", 4.0, None),
               _result("cpu", "auto", 0.4, 16 * 46080),        # fp32: 2x bf16
               _result("cpu", "int8", 0.3, 16 * 12240),        # 0.53x
               _result("disk", "int4", 0.5, 16 * 7200)]        # 0.31x: over its goal
    table, data = report(results, LIMITS)
    rows = {row["label"]: row for row in data["tiers"]}
    assert list(rows) == ["recompute", "cpu", "cpu/int8", "disk/int4"]
    assert rows["cpu"]["bytes_ratio_to_bf16"] == pytest.approx(2.0) and rows["cpu"]["bytes_goal"] is None
    assert rows["cpu/int8"]["bytes_ratio_to_bf16"] == pytest.approx(12240 / 23040)
    assert rows["cpu/int8"]["verdict"] == "met; bytes met (<=0.55x bf16)"
    assert rows["disk/int4"]["verdict"] == "met; bytes MISSED (<=0.3x bf16)"
    assert rows["recompute"]["bytes_per_token"] is None
    line = next(line for line in table.splitlines() if line.startswith("cpu/int8"))
    assert "12240" in line and "0.53x" in line


def test_the_dtype_list_is_checked() -> None:
    assert tier_dtypes("auto, int8,int4") == ["auto", "int8", "int4"]
    for bad in ("int3", "", "auto,fp8"):
        with pytest.raises(ValueError, match="--kv-tier-dtypes takes"):
            tier_dtypes(bad)
    result = subprocess.run([sys.executable, "-m", "tandem", "bench", "kv-tiers", "--kv-tier-dtypes", "int3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--kv-tier-dtypes takes" in result.stderr
