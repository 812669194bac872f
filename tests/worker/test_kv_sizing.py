"""The engine's weight-memory checks size a checkpoint as the engine holds it."""

from __future__ import annotations

import shutil
from pathlib import Path

from tandem.config import EngineConfig, LoadConfig
from tandem.distributed.pipeline_parallel import PipelineStage
from tandem.sizing.examples import EXAMPLES_DIR
from tandem.worker.kv_sizing import planned_bytes


def test_int4_experts_are_counted_packed_not_in_the_run_dtype(tmp_path: Path) -> None:
    """Kimi K2.5's experts stay INT4 in the engine (layers/int4_experts.py): counting them in
    bf16 would over-state the weights 2.2x on these shapes (and refuse a model that fits, or
    leave a GPU no KV budget)."""
    packed_dir = tmp_path / "packed"
    packed_dir.mkdir()
    shutil.copy(EXAMPLES_DIR / "kimi-k2.5-mini" / "config.json", packed_dir / "config.json")
    config = EngineConfig(model=str(packed_dir), load=LoadConfig(dtype="bfloat16"))
    stage = PipelineStage.whole(3)
    weights, _ = planned_bytes(config, packed_dir, stage)
    from tandem.bench.offline_layouts import dense_experts_config

    dense_dir = dense_experts_config(packed_dir)
    dense, _ = planned_bytes(EngineConfig(model=str(dense_dir), load=LoadConfig(dtype="bfloat16")), dense_dir, stage)
    assert 4.5e9 < weights < 5.3e9 and 2.0 < dense / weights < 2.4
