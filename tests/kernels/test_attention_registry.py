"""Attention backends by name, and what each says it can do."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.kernels.attention_registry import (
    AttentionBackendRegistry,
    AttentionBackendSpec,
    attention_capabilities,
    builtin_attention_backends,
    latent_decoder,
)
from tandem.kernels.base import AttentionCapabilities
from tandem.kernels.torch_attention import TorchAttentionBackend


def test_auto_resolves_by_device() -> None:
    assert attention_capabilities("auto", "cuda").gpu_layer_passes
    assert attention_capabilities("triton", "cpu").pads_decode_rows
    assert not attention_capabilities("auto", "cpu").pads_decode_rows
    assert not attention_capabilities("torch", "cuda").gpu_layer_passes


def test_an_unknown_backend_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="choose auto, cpu, torch, triton"):
        attention_capabilities("cuda", "cpu")


def test_a_registered_backend_is_built_by_name_and_auto_is_reserved() -> None:
    registry = builtin_attention_backends()
    flagged = AttentionCapabilities(pads_decode_rows=True)
    registry.register(AttentionBackendSpec("mine", flagged, lambda d, t, r: TorchAttentionBackend()))
    assert type(registry.make("mine", Path("."))) is TorchAttentionBackend
    assert registry.resolve("mine", "cpu").capabilities is flagged
    with pytest.raises(ValueError, match="already registered"):
        AttentionBackendRegistry().register(AttentionBackendSpec("auto", flagged, lambda d, t, r: None))


def test_mla_decodes_on_torch_when_the_backend_cannot_take_latents() -> None:
    able = TorchAttentionBackend()
    assert latent_decoder(able) is able
    unable = TorchAttentionBackend()
    unable.capabilities = AttentionCapabilities(latent_decode=False)
    fallback = latent_decoder(unable)
    assert fallback is not unable and fallback.capabilities.latent_decode
