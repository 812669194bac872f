"""Build a model from its config and fill it: safetensors (mmap), or dummy random weights."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.config import ModelConfig
from tandem.distributed.expert_parallel import ExpertParallel
from tandem.distributed.pipeline_parallel import PipelineStage
from tandem.distributed.tensor_parallel import SINGLE_RANK, TensorParallel
from tandem.kernels.base import AttentionBackend
from tandem.models.registry import model_class

logger = logging.getLogger(__name__)


def read_model_config(hf_dir: Path) -> ModelConfig:
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {hf_dir}")
    hf = json.loads(config_path.read_text())
    generation = hf_dir / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            base = hf.get("eos_token_id")
            merged = set(base if isinstance(base, list) else [] if base is None else [base])
            merged |= set(eos if isinstance(eos, list) else [eos])
            hf["eos_token_id"] = sorted(merged)
    return ModelConfig.from_hf(hf)


def iter_safetensors(hf_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {hf_dir} (use load_format='dummy' for random weights)")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, handle.get_tensor(name)


def build_model(
    config: ModelConfig, backend: AttentionBackend, max_positions: int, dtype: torch.dtype,
    tp: TensorParallel = SINGLE_RANK, stage: PipelineStage | None = None, ep: ExpertParallel | None = None,
) -> torch.nn.Module:
    """The model for this rank: the whole of it, or its tensor-parallel share of each layer
    under `tp`, only its pipeline stage's layers under `stage`, and only its share of the
    experts (whole) under `ep`."""
    cls = model_class(config.architecture)
    model = cls(config, backend, max_positions, dtype, tp=tp, stage=stage, ep=ep)
    return model.to(dtype).eval()


def load_weights(model: torch.nn.Module, hf_dir: Path) -> None:
    loaded = model.load_weights(iter_safetensors(hf_dir))
    missing = model.expected_weight_names() - loaded
    if missing:
        raise ValueError(f"checkpoint in {hf_dir} lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights of the right scale, for performance work on configs we have no weights for."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith(".bias"):
            param.data.zero_()
        else:
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * 0.02
            param.data.copy_(values)
