"""Settings that cannot work together are refused from the config alone, and each check can fail."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from tandem.config import (
    CacheConfig,
    EngineConfig,
    KVTiersConfig,
    KVTransferConfig,
    LoadConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tandem.config_checks import check_engine_config

CPU = EngineConfig("smollm2-135m", load=LoadConfig(device="cpu", dtype="float32"))
TP2 = ParallelConfig.of(2, 2, "mp")


@pytest.mark.parametrize(("change", "message"), [
    ({"parallel": TP2, "speculative": SpeculativeConfig(method="draft_model", model="x", num_speculative_tokens=2)},
     "speculative method 'draft_model' runs its model beside a whole target"),
    ({"parallel": TP2, "kv_transfer": KVTransferConfig(role="prefill")},
     "--tensor-parallel-size or --pipeline-parallel-size > 1 does not yet work with --role"),
    ({"parallel": TP2, "kv_tiers": KVTiersConfig(cpu_bytes=1 << 20)}, "or the KV tiers"),
    ({"cache": CacheConfig(kv_cache_dtype="int4")}, "--kv-cache-dtype must be one of auto, bfloat16, fp8, int8, not 'int4'"),
    ({"scheduler": SchedulerConfig(async_scheduling="on"), "parallel": TP2},
     "--async-scheduling on needs one rank"),
    ({"scheduler": SchedulerConfig(async_scheduling="on"),
      "speculative": SpeculativeConfig(method="ngram", num_speculative_tokens=2)}, "and no speculative decoding"),
    ({"scheduler": SchedulerConfig(async_scheduling="sometimes")}, "--async-scheduling must be one of auto, on, off"),
    ({"load": LoadConfig(device="cpu", quantization="int4")}, "--quantization must be none, int8 or w8a16, not 'int4'"),
    ({"load": LoadConfig(device="cpu", dtype="float32", quantization="w8a16")},
     "--quantization w8a16 widens 8-bit weights to bf16 rows: it needs --dtype bfloat16, not float32"),
    ({"cache": CacheConfig(block_size=0)}, "--block-size must be a whole number of tokens from 1 to 1024, not 0"),
    ({"cache": CacheConfig(block_size=4096)}, "--block-size must be a whole number of tokens from 1 to 1024"),
    ({"cache": CacheConfig(memory_utilization=1.2)}, "--memory-utilization must be in (0, 1], not 1.2"),
    ({"cache": CacheConfig(memory_utilization=0.0)}, "--memory-utilization must be in (0, 1], not 0.0"),
    ({"load": LoadConfig(device="cpu", decode_weights="float8")}, "decode weights must be none or one of"),
    ({"load": LoadConfig(device="cpu", dtype="bfloat16", decode_weights="float32")},
     "--decode-weights float32 keeps an fp32 model's own rows; this model runs in bfloat16"),
])
def test_incompatible_settings_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        check_engine_config(replace(CPU, **change))
    assert message in str(info.value)


@pytest.mark.parametrize("change", [
    {},
    {"parallel": TP2},
    {"kv_transfer": KVTransferConfig(role="prefill")},
    {"cache": CacheConfig(kv_cache_dtype="fp8"), "load": LoadConfig(device="cpu", attention_backend="triton")},
    {"cache": CacheConfig(kv_cache_dtype="fp8")},
    {"cache": CacheConfig(kv_cache_dtype="fp8"), "load": LoadConfig(device="cpu", attention_backend="torch")},
    {"cache": CacheConfig(kv_cache_dtype="fp8"), "kv_transfer": KVTransferConfig(role="decode"),
     "kv_tiers": KVTiersConfig(cpu_bytes=1 << 20, codec="int8")},
    {"cache": CacheConfig(kv_cache_dtype="fp8"),
     "speculative": SpeculativeConfig(method="ngram", num_speculative_tokens=2)},
    {"cache": CacheConfig(kv_cache_dtype="int8")},
    {"cache": CacheConfig(kv_cache_dtype="int8"), "load": LoadConfig(device="cpu", attention_backend="triton")},
    {"cache": CacheConfig(kv_cache_dtype="int8"), "load": LoadConfig(device="cuda")},
    {"cache": CacheConfig(kv_cache_dtype="int8"),
     "speculative": SpeculativeConfig(method="ngram", num_speculative_tokens=2)},
    {"cache": CacheConfig(kv_cache_dtype="int8"), "kv_transfer": KVTransferConfig(role="prefill", shared_memory=True)},
    {"cache": CacheConfig(kv_cache_dtype="int8"), "kv_transfer": KVTransferConfig(role="decode"),
     "kv_tiers": KVTiersConfig(cpu_bytes=1 << 20, codec="int4")},
    {"cache": CacheConfig(kv_cache_dtype="int8"), "load": LoadConfig(device="cpu", attention_backend="torch"),
     "parallel": TP2},
    {"load": LoadConfig(device="cpu", decode_weights="int4", quantization="int8")},
    {"load": LoadConfig(device="cpu", dtype="bfloat16", decode_weights="float32", decode_weights_max_tokens=0)},
])
def test_settings_that_work_together_pass(change: dict) -> None:
    check_engine_config(replace(CPU, **change))


def test_the_checks_import_no_torch() -> None:
    """The API process of `tandem serve` parses the flags, and it never imports torch."""
    script = "import sys, tandem.config_checks; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
