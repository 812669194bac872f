"""What a checkpoint's `quantization_config` says about its weights, read without torch.

Kimi K2.5 (and K2-Thinking) ship their routed experts as `compressed-tensors` pack-quantized
INT4: every `Linear` the `config_groups` target is stored as 4-bit levels with one bf16 scale
per group of 32 inputs, symmetric, except the modules its `ignore` list names (attention,
shared experts, the dense MLP, the LM head), which stay bf16. The API process reads the model
config too and must not import torch, which the `compressed-tensors` package needs, so the
few rules tandem relies on are read here from the JSON; the tests check them against the
package's own matcher and write their checkpoints with the package.

Only the scheme tandem's kernels compute is accepted (`SUPPORTED`); anything else is refused
with what it is, never loaded as something it is not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

COMPRESSED_TENSORS = "compressed-tensors"
# The scheme tandem computes: W4A16, integer levels, one scale per 32 inputs, no zero point.
SUPPORTED = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}


@dataclass(frozen=True)
class WeightQuantization:
    """compressed-tensors pack-quantized INT4 weights: which modules, and how."""

    num_bits: int
    group_size: int
    symmetric: bool
    targets: tuple[str, ...]
    ignore: tuple[str, ...]

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
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError("compressed-tensors activation quantization is not supported (tandem runs W4A16)")
        return cls(num_bits=4, group_size=32, symmetric=True, targets=tuple(group.get("targets") or ()),
                   ignore=tuple(quant.get("ignore") or ()))

    def quantizes(self, *names: str) -> bool:
        """Whether the Linear module known by any of `names` (its checkpoint name, and the
        same without a wrapper's prefix) is stored quantized: targeted (`Linear`, a name, or
        a `re:` pattern) and not ignored. A name matches a rule as compressed-tensors
        matches it: `re:` patterns with re.match, other rules by equality."""
        targeted = any(target == "Linear" or _matches(name, target) for name in names for target in self.targets)
        return targeted and not any(_matches(name, rule) for name in names for rule in self.ignore)


def _matches(name: str, rule: str) -> bool:
    if rule.startswith("re:"):
        return re.match(rule[3:], name) is not None
    return name == rule
