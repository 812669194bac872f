"""Hand the one-call passes for the small per-layer ops to the modules that use them (RMSNorm,
the rotary embedding and the gated MLP's silu-and-mul): the C passes on the CPU
(tandem/kernels/layer_ops.py), the Triton kernels on a GPU (tandem/kernels/gpu)."""

from __future__ import annotations

from torch import nn

from tandem.kernels.layer_ops import LayerOpsKernel
from tandem.layers.linear import GateUpLinear, SiluMulPass
from tandem.layers.norm import NormPass, RMSNorm
from tandem.layers.rotary import RotaryEmbedding, RotaryPass


def attach_layer_ops(model: nn.Module, ops: LayerOpsKernel) -> int:
    """Give every norm, rotary embedding and gate/up projection of `model` the C passes, and
    the model itself as `layer_ops` (its runner's sampler takes the C argmax from there);
    returns how many modules took them."""
    users = [m for m in model.modules() if isinstance(m, RMSNorm | RotaryEmbedding | GateUpLinear)]
    for module in users:
        module.ops = ops
    model.layer_ops = ops
    return len(users)


def attach_gpu_passes(model: nn.Module, norm: NormPass, rotary: RotaryPass, silu_mul: SiluMulPass) -> int:
    """Give every RMSNorm, rotary embedding and gate/up projection of `model` its pass (the
    Triton kernels, on a GPU); returns how many modules took one."""
    taken = 0
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.ops = norm
        elif isinstance(module, RotaryEmbedding):
            module.ops = rotary
        elif isinstance(module, GateUpLinear):
            module.ops = silu_mul
        else:
            continue
        taken += 1
    return taken
