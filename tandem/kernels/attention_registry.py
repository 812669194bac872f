"""Attention backends by name: what `--attention-backend` may choose, and what each can do.

Every attention layer (the GQA one, MLA, the EAGLE-3 head) takes the backend the worker built
from here; a caller that needs to know whether a backend pads decode rows, runs the GPU
layer passes or MLA's latent decode asks its `capabilities` instead of testing its name. A backend is
built lazily (the Triton one imports Triton), but its capabilities are known before it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tandem.kernels.base import AttentionBackend, AttentionCapabilities

# Builds a backend for kernels cached under a directory, on a device type ("cpu", "cuda");
# `required` is False when "auto" chose it: a backend that cannot build may fall back.
BackendFactory = Callable[[Path, str, bool], AttentionBackend]


@dataclass(frozen=True)
class AttentionBackendSpec:
    name: str
    capabilities: AttentionCapabilities
    build: BackendFactory


class AttentionBackendRegistry:
    def __init__(self) -> None:
        self._specs: dict[str, AttentionBackendSpec] = {}

    def register(self, spec: AttentionBackendSpec) -> None:
        if spec.name in self._specs or spec.name == "auto":
            raise ValueError(f"attention backend {spec.name!r} is already registered")
        self._specs[spec.name] = spec

    def names(self) -> tuple[str, ...]:
        return tuple(self._specs)

    def resolve(self, choice: str, device_type: str) -> AttentionBackendSpec:
        """The spec a choice names; "auto" is Triton on a GPU (the C kernels read host memory),
        else the CPU kernels (which fall back to torch when they do not build)."""
        if choice == "auto":
            choice = "triton" if device_type == "cuda" else "cpu"
        spec = self._specs.get(choice)
        if spec is None:
            raise ValueError(f"unknown attention backend {choice!r}; choose auto, {', '.join(self._specs)}")
        return spec

    def make(self, choice: str, cache_dir: Path, device_type: str = "cpu") -> AttentionBackend:
        return self.resolve(choice, device_type).build(cache_dir, device_type, choice != "auto")


def _torch(cache_dir: Path, device_type: str, required: bool) -> AttentionBackend:
    from tandem.kernels.torch_attention import TorchAttentionBackend

    return TorchAttentionBackend()


def _triton(cache_dir: Path, device_type: str, required: bool) -> AttentionBackend:
    from tandem.kernels.gpu import available

    reason = available(device_type)
    if reason:
        raise ValueError(f"--attention-backend triton: {reason}")
    from tandem.kernels.gpu.backend import TritonAttentionBackend

    return TritonAttentionBackend()


def _cpu(cache_dir: Path, device_type: str, required: bool) -> AttentionBackend:
    from tandem.kernels.cpu_attention import build_cpu_backend

    return build_cpu_backend(cache_dir, required)


def builtin_attention_backends() -> AttentionBackendRegistry:
    """tandem's backends: the C kernels on a CPU, plain torch, the Triton kernels."""
    from tandem.kernels.gpu import TRITON_CAPABILITIES

    registry = AttentionBackendRegistry()
    torch_capabilities = AttentionCapabilities(latent_decode=True)
    registry.register(AttentionBackendSpec("cpu", torch_capabilities, _cpu))
    registry.register(AttentionBackendSpec("torch", torch_capabilities, _torch))
    registry.register(AttentionBackendSpec("triton", TRITON_CAPABILITIES, _triton))
    return registry


# The registry `--attention-backend` chooses from; `register_attention_backend` adds to it.
ATTENTION_BACKENDS = builtin_attention_backends()


def register_attention_backend(name: str, capabilities: AttentionCapabilities, build: BackendFactory) -> None:
    ATTENTION_BACKENDS.register(AttentionBackendSpec(name, capabilities, build))


def make_attention_backend(choice: str, cache_dir: Path, device_type: str = "cpu") -> AttentionBackend:
    """`--attention-backend`: "torch", "cpu" (the kernel, or an error), "triton" (the Triton
    kernels: on a GPU, or on this CPU under TRITON_INTERPRET=1), or "auto" (on a GPU Triton,
    else the C kernel when it builds, else torch with a warning)."""
    return ATTENTION_BACKENDS.make(choice, cache_dir, device_type)


def attention_capabilities(choice: str, device_type: str) -> AttentionCapabilities:
    """What the backend `choice` resolves to on `device_type` can do, before building it."""
    return ATTENTION_BACKENDS.resolve(choice, device_type).capabilities


def latent_decoder(backend: AttentionBackend) -> AttentionBackend:
    """The backend MLA's absorbed decode runs on: the given one when it can, else torch's."""
    if backend.capabilities.latent_decode:
        return backend
    return ATTENTION_BACKENDS.make("torch", Path(), "cpu")
