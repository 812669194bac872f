"""Hand the C passes for the small per-layer ops (tandem/kernels/layer_ops.py) to the modules
that use them: RMSNorm, the rotary embedding and the gated MLP's silu-and-mul."""

from __future__ import annotations

from torch import nn

from tandem.kernels.layer_ops import LayerOpsKernel
from tandem.layers.linear import GateUpLinear
from tandem.layers.norm import NormPass, RMSNorm
from tandem.layers.rotary import RotaryEmbedding


def attach_layer_ops(model: nn.Module, ops: LayerOpsKernel) -> int:
    """Give every norm, rotary embedding and gate/up projection of `model` the C passes, and
    the model itself as `layer_ops` (its runner's sampler takes the C argmax from there);
    returns how many modules took them."""
    users = [m for m in model.modules() if isinstance(m, RMSNorm | RotaryEmbedding | GateUpLinear)]
    for module in users:
        module.ops = ops
    model.layer_ops = ops
    return len(users)


def attach_norm_pass(model: nn.Module, norm: NormPass) -> int:
    """Give every RMSNorm of `model` `norm` (the Triton kernel, on a GPU); returns how many."""
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for module in norms:
        module.ops = norm
    return len(norms)
