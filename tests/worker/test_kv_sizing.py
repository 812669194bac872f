"""The engine's weight-memory checks size a checkpoint as the engine holds it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

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


def test_the_engine_s_memory_report_plans_and_counts_the_packed_experts(tmp_path: Path) -> None:
    """The start-up line "weights X GiB ... planned: weights Y GiB" for an INT4 checkpoint:
    the plan keeps the packed experts packed in the run dtype (keep_packed), and the measured
    side counts the experts' buffers (they are not parameters)."""
    import json

    import torch

    from tandem.config import ModelConfig
    from tandem.kernels.torch_attention import TorchAttentionBackend
    from tandem.loader.model_loader import build_model
    from tandem.sizing.devices import parse_devices
    from tandem.sizing.memory import PlanRequest, plan_memory
    from tandem.worker.model_builder import model_bytes

    hf = json.loads((EXAMPLES_DIR / "kimi-k2.5-mini" / "config.json").read_text())
    request = dict(devices=parse_devices("1xcpu:64GiB"), dtype="bfloat16")
    packed = plan_memory(hf, PlanRequest(**request, keep_packed=True)).tandem.stages[0].weight_bytes
    widened = plan_memory(hf, PlanRequest(**request)).tandem.stages[0].weight_bytes
    assert 2.0 < widened / packed < 2.4
    small = {**hf, "text_config": {**hf["text_config"], "hidden_size": 128, "moe_intermediate_size": 64,
                                   "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
                                   "q_lora_rank": 32, "kv_lora_rank": 32, "vocab_size": 64, "n_routed_experts": 4,
                                   "num_experts_per_tok": 2}}
    model = build_model(ModelConfig.from_hf(small), TorchAttentionBackend(), 64, torch.float32)
    experts = [m.mlp.int4 for m in model.model.layers if getattr(m.mlp, "int4", None) is not None]
    packed_bytes = sum(t.numel() * t.element_size() for e in experts for t in (e.w13, e.s13, e.w2, e.s2))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert packed_bytes > 0 and model_bytes(model) == params + packed_bytes


def test_the_plan_s_kv_bytes_per_token_are_the_engine_s_for_every_cache_dtype() -> None:
    """`tandem plan memory --kv-cache-dtype` counts a token's KV as the engine allocates it
    (model_runner.kv_bytes_per_block): GQA and MLA, float caches and int8 rows with their
    scales, at tp 1 and 2."""
    import json

    import torch

    from tandem.config import ModelConfig
    from tandem.sizing.kv import kv_bytes_per_token
    from tandem.sizing.shape import read_shape
    from tandem.worker.model_runner import kv_bytes_per_block

    gqa = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
           "hidden_size": 576, "intermediate_size": 64, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}
    mla = json.loads((EXAMPLES_DIR / "kimi-k2.5-mini" / "config.json").read_text())
    for hf in (gqa, mla):
        shape, model = read_shape(hf), ModelConfig.from_hf(hf)
        layers = model.num_hidden_layers
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("int8", torch.uint8)):
            for tp in (1, 2) if hf is gqa else (1,):
                engine = kv_bytes_per_block(model, 16, dtype, tp, layers) // 16
                assert kv_bytes_per_token(shape, tp, layers, name) == engine, (hf["architectures"], name, tp)


@pytest.mark.parametrize(("name", "devices", "tp"), [
    ("llama-3.1-8b", "1xH100", 1), ("llama-3.1-8b", "1xH200", 1), ("llama-4-scout", "2xH200", 2),
    ("kimi-k2.5", "8xH100", 8),
])
@pytest.mark.parametrize("utilization", [0.92, 0.95])
def test_a_gpu_rank_gives_its_kv_cache_what_the_plan_prints(tmp_path: Path, name: str, devices: str, tp: int,
                                                           utilization: float) -> None:
    """`tandem plan memory` is the promise: a GPU rank that finds the device as the plan
    assumes (its total, less the CUDA context and NCCL in use) sizes its KV cache to the plan's
    figure, byte for byte, under the same --memory-utilization."""
    from tandem.config import CacheConfig, ParallelConfig
    from tandem.sizing.devices import parse_devices
    from tandem.sizing.memory import PlanRequest, plan_memory
    from tandem.sizing.sharding import Parallel
    from tandem.worker.kv_sizing import gpu_budget_from

    model_dir = tmp_path / name
    model_dir.mkdir()
    shutil.copy(EXAMPLES_DIR / name / "config.json", model_dir / "config.json")
    hf = json.loads((model_dir / "config.json").read_text())
    plan = plan_memory(hf, PlanRequest(parse_devices(devices), Parallel(tp, 1), dtype="bfloat16", keep_packed=True,
                                       memory_utilization=utilization))
    planned = plan.tandem.stages[0]
    config = EngineConfig(model=str(model_dir), load=LoadConfig(dtype="bfloat16"),
                          cache=CacheConfig(memory_utilization=utilization), parallel=ParallelConfig.of(tp, tp))
    num_layers = (hf.get("text_config") or hf)["num_hidden_layers"]
    weights, activation = planned_bytes(config, model_dir, PipelineStage.whole(num_layers))
    assert (weights, activation) == (planned.weight_bytes, planned.activation_bytes)
    total = planned.device_bytes
    budget = gpu_budget_from(total - planned.reserved_bytes, total, weights, activation, utilization, "cuda:0")
    assert budget == planned.kv_bytes > 0


def test_a_gpu_rank_whose_weights_leave_no_kv_room_says_so() -> None:
    from tandem.worker.kv_sizing import gpu_budget_from

    gib = 1 << 30
    with pytest.raises(ValueError, match="--memory-utilization 0.9 .* leave no room for KV"):
        gpu_budget_from(79 * gib, 80 * gib, 72 * gib, gib, 0.9, "cuda:0")
    # the activation peak and what is in use come out of the rest first: a busy device gives way
    assert gpu_budget_from(70 * gib, 80 * gib, 10 * gib, gib, 0.9, "cuda:0") == 59 * gib
    assert gpu_budget_from(79 * gib, 80 * gib, 10 * gib, gib, 0.9, "cuda:0") == 62 * gib
