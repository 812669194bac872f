"""What a checkpoint's `quantization_config` says about its weights, read without torch.

Kimi K2.5 (and K2-Thinking) ship their routed experts as `compressed-tensors` pack-quantized
INT4: every `Linear` the `config_groups` target is stored as 4-bit levels with one bf16 scale
per group of 32 inputs, symmetric, except the modules its `ignore` list names (attention,
shared experts, the dense MLP, the LM head), which stay bf16. The config is parsed, and its
rules matched as compressed-tensors matches them, by the memory plan's reader
(`tandem.sizing.quant`, torch-free: the API process reads the model config too and must not
import torch, which the `compressed-tensors` package needs); the tests check the matching
against the package's own matcher and write their checkpoints with the package.

The plan sizes more schemes than the engine computes: only `SUPPORTED` (W4A16 integer
levels, one scale per 32 inputs, no zero point) loads; anything else is refused here with the
field that differs, never loaded as something it is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.sizing.errors import PlanError
from tandem.sizing.quant import CompressedTensors, read_compressed_tensors

COMPRESSED_TENSORS = "compressed-tensors"
# The scheme tandem computes: W4A16, integer levels, one scale per 32 inputs, no zero point.
SUPPORTED = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}


@dataclass(frozen=True)
class WeightQuantization:
    """compressed-tensors pack-quantized INT4 weights: which modules, and how."""

    rules: CompressedTensors

    num_bits = SUPPORTED["num_bits"]
    group_size = SUPPORTED["group_size"]
    symmetric = SUPPORTED["symmetric"]

    @property
    def ignore(self) -> tuple[str, ...]:
        return self.rules.ignore

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> WeightQuantization | None:
        """The checkpoint's scheme, None when it has no compressed-tensors quantization (fp8
        checkpoints are refused by the model that meets their scales); a scheme tandem
        cannot compute is a ValueError saying which field."""
        quant = hf.get("quantization_config")
        if not isinstance(quant, dict) or quant.get("quant_method") != COMPRESSED_TENSORS:
            return None
        if quant.get("format") != "pack-quantized":
            raise ValueError(f"compressed-tensors format {quant.get('format')!r} is not supported; "
                             "tandem loads pack-quantized INT4 weights")
        groups = quant.get("config_groups") or {}
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors checkpoints with {len(groups)} config groups are not "
                             "supported; tandem loads one INT4 weight scheme")
        group = next(iter(groups.values())) or {}
        weights = group.get("weights") or {}
        for key, value in SUPPORTED.items():
            if weights.get(key) != value:
                raise ValueError(f"compressed-tensors weights {key}={weights.get(key)!r} are not supported; "
                                 f"tandem computes {SUPPORTED}")
        if weights.get("dynamic") or weights.get("actorder"):
            raise ValueError("compressed-tensors dynamic or activation-ordered weights are not supported")
        if str(weights.get("scale_dtype") or "bfloat16").removeprefix("torch.") != "bfloat16":
            raise ValueError(f"compressed-tensors scale_dtype {weights.get('scale_dtype')!r} is not supported; "
                             "tandem keeps bf16 scales")
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError("compressed-tensors activation quantization is not supported (tandem runs W4A16)")
        try:
            return cls(read_compressed_tensors(quant))
        except PlanError as error:
            raise ValueError(str(error)) from None

    def quantizes(self, *names: str) -> bool:
        """Whether the Linear module known by every one of `names` (its checkpoint name, and
        the same without a wrapper's prefix) is stored quantized: targeted and not ignored."""
        return all(self.rules.scheme_for(name) is not None for name in names)
