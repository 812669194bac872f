"""`tandem plan`: capacity planning commands: `memory` (how a model splits over devices),
`profile` and `pools` (how many prefill and decode workers a traffic mix needs).

Torch-free like the rest of tandem.plan and tandem.sizing: planning a 1T-parameter model takes a config.json
and a few milliseconds, not the weights or a GPU.
"""

from __future__ import annotations

import argparse
import json
import textwrap

from tandem.flags.table import Command, Flag, FlagTable
from tandem.plan.pools.cli import add_pools_parsers
from tandem.plan.report import format_memory_plan, plan_to_dict
from tandem.sizing.devices import CUDA_CONTEXT_BYTES, NCCL_BYTES, MiB, parse_devices
from tandem.sizing.examples import EXAMPLE_NAMES, load_config
from tandem.sizing.memory import (
    DEFAULT_MEMORY_UTILIZATION,
    DTYPE_CHOICES,
    KV_DTYPE_CHOICES,
    PlanRequest,
    plan_memory,
)
from tandem.sizing.shape import SUPPORTED
from tandem.sizing.sharding import Parallel

_PLAN_DESCRIPTION = """\
Plan a deployment. `memory` reads a model's config.json and needs neither the hardware nor
the weights; `profile` measures step costs on this machine and `pools` sizes the prefill and
decode pools for a traffic mix from them.
"""

def _fill(text: str) -> str:
    return textwrap.fill(" ".join(text.split()), width=92)


_MEMORY_DESCRIPTION = "\n\n".join([
    _fill("""Where the memory goes on each rank when CONFIG runs on --devices: the weights' shard,
          the activation peak of a --max-num-batched-tokens step, CUDA context and NCCL, and the
          KV cache that is left: bytes per token, tokens that fit, and sequences of
          --max-model-len that fit at once. Beside it, what vLLM would leave with its defaults
          (gpu_memory_utilization 0.9) on the same devices, with the same weights and the same
          activation formula."""),
    "CONFIG is a config.json, a directory holding one, or a shipped example:\n  "
    + ", ".join(EXAMPLE_NAMES),
    _fill(f"""Architectures: {', '.join(SUPPORTED)}. Kimi-K2 is a DeepseekV3ForCausalLM. Llama 4's
          vision tower is counted apart (a text-only server does not load it); Kimi K2.5's is
          counted in the vLLM column only (vLLM loads it, tandem serves the text decoder).
          Checkpoints quantized as FP8 blocks or compressed-tensors pack-quantized integers (Kimi
          K2.5's INT4 experts) are counted as stored."""),
    _fill(f"""Devices: NxH100 (79.11 GiB each), NxH200 (139.81 GiB each), Nxgpu:SIZE for another
          GPU (SIZE as CUDA reports it), cpu:SIZE for the CPU engine. GPUs also lose
          {CUDA_CONTEXT_BYTES // MiB} MiB to the CUDA context, and {NCCL_BYTES // MiB} MiB to NCCL
          when ranks talk."""),
    _fill("""tandem caps weights + KV cache at --memory-utilization of each device; the activation
          peak and those allowances must fit in the rest. vLLM's 0.9 caps everything, activations
          included, and it sizes them for 8192 tokens and 1024 sequences on 80 GB-class GPUs:
          that, not the weights, is where the two columns differ."""),
    """examples:
  tandem plan memory llama-4-scout --devices 2xH200 --tp 2
  tandem plan memory kimi-k2 --devices 8xH200 --tp 8 --kv-cache-dtype fp8
  tandem plan memory kimi-k2.5 --devices 8xH100 --tp 8 --ep --max-model-len 131072
  tandem plan memory path/to/model/config.json --devices cpu:24GiB --json""",
])


MEMORY_CONFIG_FLAGS = FlagTable(None, (
    Flag(
        "config", metavar="CONFIG",
        help="config.json, a directory holding one, or an example name",
    ),
))
MEMORY_DEVICE_FLAGS = FlagTable("where it runs", (
    Flag("--devices", default="1xH100", help="e.g. 8xH100, 2xH200, cpu:24GiB (default: 1xH100)"),
    Flag("--tp", type=int, help="tensor-parallel size (default: the devices not used by --pp)"),
    Flag("--pp", default=1, type=int, help="pipeline-parallel stages (default: 1)"),
    Flag(
        "--ep", short="--enable-expert-parallel", dest_name="ep", switch=True,
        help="expert parallelism (vLLM's --enable-expert-parallel): deal the routed experts out whole "
        "over the tp ranks; attention stays tensor-parallel",
    ),
    Flag(
        "--memory-utilization", default=DEFAULT_MEMORY_UTILIZATION, type=float,
        help="fraction of each device for weights + KV cache "
        f"(default: {DEFAULT_MEMORY_UTILIZATION})",
    ),
))
MEMORY_MODEL_FLAGS = FlagTable("model and scheduler", (
    Flag(
        "--dtype", default="auto", choices=DTYPE_CHOICES,
        help="weight dtype; auto: the config's (FP8 blocks if it ships them); "
        "fp8: 128x128-block FP8 matmul weights",
    ),
    Flag(
        "--kv-cache-dtype", default="auto", choices=KV_DTYPE_CHOICES,
        help="auto: the activation dtype",
    ),
    Flag(
        "--max-num-batched-tokens", default=2048, type=int,
        help="tokens per step, sizes the activation peak (default: 2048, the engine's)",
    ),
    Flag(
        "--max-num-seqs", default=128, type=int,
        help="sequences per step, sizes the sampler's logits (default: 128, the engine's)",
    ),
    Flag(
        "--max-model-len", type=int,
        help="longest sequence (default: the config's max_position_embeddings)",
    ),
))
MEMORY_OUTPUT_FLAGS = FlagTable(None, (
    Flag("--json", switch=True, help="print the plan as JSON"),
))


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser("plan", help="capacity planning from a config.json (no weights needed)",
                                 description=_PLAN_DESCRIPTION)
    commands = plan.add_subparsers(dest="plan_command", required=True, metavar="PLAN")
    memory = commands.add_parser(
        "memory", help="weights, activations and KV cache per rank; tokens that fit",
        description=_MEMORY_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    MEMORY_CONFIG_FLAGS.add_to(memory)
    MEMORY_DEVICE_FLAGS.add_to(memory)
    MEMORY_MODEL_FLAGS.add_to(memory)
    MEMORY_OUTPUT_FLAGS.add_to(memory)
    Command(cmd_plan_memory, check_plan_memory).install(memory)
    add_pools_parsers(commands)


def check_plan_memory(args: argparse.Namespace) -> None:
    """A bad --devices spec is a parse error, before any config is read."""
    parse_devices(args.devices)


def cmd_plan_memory(args: argparse.Namespace) -> int:
    devices = parse_devices(args.devices)
    tp = args.tp if args.tp is not None else max(devices.count // max(args.pp, 1), 1)
    name, config = load_config(args.config)
    request = PlanRequest(
        devices=devices, parallel=Parallel(tp=tp, pp=args.pp, ep=args.ep), dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        memory_utilization=args.memory_utilization)
    plan = plan_memory(config, request, name)
    print(json.dumps(plan_to_dict(plan), indent=2) if args.json else format_memory_plan(plan))
    return 0

