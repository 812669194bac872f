"""One tensor-parallel rank of tests/distributed/test_tensor_parallel.py, run as a script.

Joins a gloo group, builds its share of the model saved at MODEL_DIR, feeds a sequence
through the paged path (a prefill chunk, a chunk over its cached context, decodes) and
saves the logits of every position to OUT.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tandem.batch.prepared import ScheduledChunk, prepare_batch
from tandem.distributed.tensor_parallel import TensorParallel
from tandem.kernels.base import kv_cache_shape
from tandem.kernels.torch_attention import TorchAttentionBackend
from tandem.layers.linear import pack_weights_for_cpu
from tandem.loader.model_loader import build_model, load_weights, read_model_config
from tandem.worker.model_runner import rank_kv_spec

BLOCK = 4


def main(rank: int, world: int, port: int, model_dir: str, out: str, tokens: list[int]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    tp = TensorParallel(rank, world)
    config = read_model_config(Path(model_dir))
    model = build_model(config, TorchAttentionBackend(), 128, torch.float32, tp)
    load_weights(model, Path(model_dir))
    held = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name)
    pack_weights_for_cpu(model)
    spec = rank_kv_spec(config, tp)  # this rank's KV heads, or the whole latent (MLA)
    blocks = -(-len(tokens) // BLOCK)
    caches = [torch.zeros(kv_cache_shape(blocks, BLOCK, spec.num_heads, spec.head_dim, spec.num_planes))
              for _ in range(config.num_hidden_layers)]
    plan = [(0, 7), (7, 5)] + [(p, 1) for p in range(12, len(tokens))]
    rows = []
    for start, count in plan:
        chunk = ScheduledChunk("r", tokens[start : start + count], start, list(range(blocks)), True)
        batch = prepare_batch([chunk], BLOCK)
        with torch.inference_mode():
            rows.append(model.compute_logits(model(batch.input_ids, batch.positions, caches, batch.meta)))
    torch.save({"logits": torch.cat(rows), "held": held}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    rank, world, port = (int(a) for a in sys.argv[1:4])
    main(rank, world, port, sys.argv[4], sys.argv[5], [int(t) for t in sys.argv[6].split(",")])
