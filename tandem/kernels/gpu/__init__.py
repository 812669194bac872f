"""Triton kernels for the GPU path: the paged KV write, paged decode attention (split over
blocks for long contexts), prefill attention over a cached prefix, and RMSNorm fused with the
residual add.

They take the same tensors as the CPU backends (`tandem/kernels/base.py`: the paged cache is
[2, kv_heads, blocks, block_size, head_dim]) and run wherever Triton runs: on an NVIDIA GPU,
or on the CPU under `TRITON_INTERPRET=1`, which is how CI tests them against the torch
reference (slowly, and without bf16: the interpreter mangles bf16 loads, so bf16 is checked
on a GPU only). `available()` says whether they can run on a device here.
"""

from __future__ import annotations

import importlib.util
import os

from tandem.kernels.base import AttentionCapabilities

# The Triton backend's (gpu/backend.py), here so a caller can ask before importing Triton.
TRITON_CAPABILITIES = AttentionCapabilities(pads_decode_rows=True, gpu_layer_passes=True, scaled_kv_write=True)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device_type: str) -> str | None:
    """None when the kernels can run on tensors of `device_type`; else why not, in words."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    if device_type == "cuda" or interpreted():
        return None
    return (f"Triton kernels run on a GPU, or on the CPU only under TRITON_INTERPRET=1 (slow: "
            f"for tests); these tensors are on {device_type}")
