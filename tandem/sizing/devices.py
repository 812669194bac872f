"""Devices the plan can target, their usable memory, and the memory outside tensors on a GPU.

Usable memory is what CUDA reports as the device's total (`torch.cuda.mem_get_info`,
`total_memory`), which is less than the marketing size: the driver keeps some for itself.
The figures are the ones vLLM prints as `total_gpu_memory` at start-up:

- H100 SXM 80 GB: 79.11 GiB ("the current vLLM instance can use total_gpu_memory (79.11GiB)
  x gpu_memory_utilization (0.90) = 71.20GiB", Llama-3.1-8B on one H100; other published logs
  range from 79.11 to 79.33 GiB with driver and ECC settings);
- H200 141 GB: 139.81 GiB ("total_gpu_memory (139.81GiB)", a DeepSeek log on H200).

Other GPUs: `Nxgpu:80GiB` gives the usable size directly. A `cpu:24GiB` device is a budget of
host memory for the CPU engine.

On a GPU some memory is used outside the tensors the plan counts:

- the CUDA context: 512 MiB per device. PyTorch measured a bare context at 287 MB with CUDA's
  lazy module loading and 667 MB without (pytorch/pytorch#86509, which made lazy loading the
  default); the kernels a server loads and cuBLAS's workspaces come on top, so 512 MiB.
- NCCL: 512 MiB per device whenever it talks to other devices (tp x pp > 1). NCCL keeps a
  send and a receive buffer of NCCL_BUFFSIZE (4 MiB by default) per channel and peer for each
  protocol, tens of channels over NVLink, i.e. a few hundred MiB per communicator. This is an
  allowance, not a measurement: vLLM's logged `non_torch_memory` ranges from 0.09 GiB (one
  GPU) to several GiB (large TP groups with custom all-reduce buffers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tandem.sizing.errors import PlanError
from tandem.sizing.units import parse_memory_size

GiB = 1 << 30
MiB = 1 << 20

CUDA_CONTEXT_BYTES = 512 * MiB
NCCL_BYTES = 512 * MiB


@dataclass(frozen=True)
class DeviceKind:
    """One kind of device: its usable memory and whether CUDA's own overheads apply."""

    name: str
    memory_bytes: int
    gpu: bool
    source: str


KNOWN_GPUS = {
    "h100": DeviceKind("H100", round(79.11 * GiB), True, "vLLM's logged total_gpu_memory on an H100 80GB"),
    "h200": DeviceKind("H200", round(139.81 * GiB), True, "vLLM's logged total_gpu_memory on an H200 141GB"),
}


@dataclass(frozen=True)
class Devices:
    """`count` devices of one kind (the plan assumes one rank per device)."""

    count: int
    kind: DeviceKind

    def __str__(self) -> str:
        return f"{self.count} x {self.kind.name}"

    def reserved_bytes(self, world_size: int) -> int:
        """Memory outside tensors on each device: CUDA context, plus NCCL when ranks talk."""
        if not self.kind.gpu:
            return 0
        return CUDA_CONTEXT_BYTES + (NCCL_BYTES if world_size > 1 else 0)


_DEVICES_RE = re.compile(r"^\s*(?:(\d+)\s*[x*]\s*)?([a-z0-9]+)(?::(.+))?\s*$", re.IGNORECASE)


def parse_devices(text: str) -> Devices:
    """'8xH100', '2xH200', 'H100', 'cpu:24GiB', '4xgpu:80GiB' -> Devices."""
    match = _DEVICES_RE.match(text)
    if not match:
        raise PlanError(f"cannot read devices {text!r}; use e.g. 8xH100, 2xH200, cpu:24GiB or 4xgpu:80GiB")
    count_text, name, size = match.groups()
    count = int(count_text or 1)
    if count < 1:
        raise PlanError(f"devices {text!r}: need at least one device")
    name = name.lower()
    if name in KNOWN_GPUS and size is None:
        return Devices(count, KNOWN_GPUS[name])
    if name in ("cpu", "gpu") and size is not None:
        try:
            memory = parse_memory_size(size)
        except ValueError as exc:
            raise PlanError(f"devices {text!r}: {exc}") from None
        if memory <= 0:
            raise PlanError(f"devices {text!r}: memory must be positive")
        label = f"{name}:{size.strip()}" if name == "cpu" else f"GPU ({size.strip()})"
        return Devices(count, DeviceKind(label, memory, name == "gpu", "given on the command line"))
    known = ", ".join(kind.name for kind in KNOWN_GPUS.values())
    raise PlanError(f"unknown device {text!r}; known GPUs: {known} (e.g. 8xH100); others as "
                    "Nxgpu:SIZE (e.g. 4xgpu:80GiB, SIZE as CUDA reports it) or cpu:SIZE")
