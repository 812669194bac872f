"""`--device` and `--dtype auto`: settled without torch, from what torch was built for and the
driver's device nodes; a GPU asked for where there is none is a clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.config import CacheConfig, EngineConfig, KVTiersConfig, LoadConfig
from tandem.platform import device
from tandem.platform.device import (
    cuda_visible,
    resolve_block_size,
    resolve_chunk_blocks,
    resolve_device,
    resolve_dtype,
    torch_cuda_version,
)


def test_this_cpu_build_sees_no_gpu() -> None:
    assert torch_cuda_version() is None  # CI and the dev box install torch's CPU wheel
    assert not cuda_visible()
    assert resolve_device("auto") == "cpu"
    assert LoadConfig() == LoadConfig(dtype="float32", device="cpu")


def test_a_cuda_build_is_read_from_version_py(tmp_path, monkeypatch) -> None:
    package = tmp_path / "torch"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "version.py").write_text("__version__ = '2.11.0'\ncuda: Optional[str] = '12.8'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    try:
        assert torch_cuda_version() == "12.8"
    finally:
        monkeypatch.undo()
    nodes = tmp_path / "dev"
    monkeypatch.setattr(device, "torch_cuda_version", lambda: "12.8")
    monkeypatch.setattr(device, "_NVIDIA_CONTROL", nodes / "nvidiactl")
    assert not cuda_visible()  # a CUDA wheel, but no driver


def test_dtype_auto_follows_the_device() -> None:
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("float16", "cuda") == "float16"
    assert LoadConfig(dtype="auto", device="cpu").dtype == "float32"
    with pytest.raises(ValueError, match="--device must be one of auto, cpu, cuda"):
        LoadConfig(device="tpu")


@pytest.mark.parametrize(("given", "device", "block_size"), [
    (None, "cpu", 64), (None, "cuda", 16), (16, "cpu", 16), (128, "cuda", 128), (1, "cpu", 1),
])
def test_block_size_auto_follows_the_device(given, device, block_size) -> None:
    assert resolve_block_size(given, device) == block_size


@pytest.mark.parametrize(("given", "block_size", "chunk_blocks"), [
    (None, 64, 4), (None, 16, 16), (None, 128, 2), (None, 1024, 1), (None, 1, 256), (8, 64, 8), (3, 16, 3),
])
def test_a_tier_chunk_stays_256_tokens_unless_given(given, block_size, chunk_blocks) -> None:
    assert resolve_chunk_blocks(given, block_size) == chunk_blocks


def test_the_engine_config_settles_block_and_chunk() -> None:
    config = EngineConfig(model="smollm2-135m")
    assert (config.cache.block_size, config.kv_tiers.chunk_blocks) == (64, 4)
    config = EngineConfig(model="smollm2-135m", cache=CacheConfig(block_size=16))
    assert (config.cache.block_size, config.kv_tiers.chunk_blocks) == (16, 16)
    config = EngineConfig(model="smollm2-135m", load=LoadConfig(device="cuda", quantization="none",
                                                                decode_weights="none"))
    assert (config.cache.block_size, config.kv_tiers.chunk_blocks) == (16, 16)
    config = EngineConfig(model="smollm2-135m", kv_tiers=KVTiersConfig(chunk_blocks=2))
    assert (config.cache.block_size, config.kv_tiers.chunk_blocks) == (64, 2)


def test_the_flags_leave_block_and_chunk_to_the_device() -> None:
    from tandem.cli.main import build_parser
    from tandem.flags.engine import engine_config

    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert (args.block_size, args.kv_chunk_blocks) == (None, None)
    config = engine_config(args)
    assert (config.cache.block_size, config.kv_tiers.chunk_blocks) == (64, 4)
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--block-size", "32"])
    assert engine_config(args).cache.block_size == 32
    with pytest.raises(ValueError, match="--block-size must be a whole number"):
        engine_config(build_parser().parse_args(["generate", "--prompt", "hi", "--block-size", "0"]))
    with pytest.raises(ValueError, match="--kv-chunk-blocks and --kv-store-admit-after must be at least 1"):
        engine_config(build_parser().parse_args(["serve", "--kv-chunk-blocks", "0"]))  # not a silent 16


def test_the_api_process_settles_the_device_without_torch() -> None:
    code = ("import sys; from tandem.config import LoadConfig; c = LoadConfig(); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(c.device, c.dtype)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["cpu", "float32"]


def test_cuda_where_there_is_none_is_a_clear_error(capsys) -> None:
    from tandem.cli.main import main

    assert main(["generate", "--device", "cuda", "--prompt", "hi", "--max-tokens", "1"]) == 2
    assert "--device cuda: this torch sees no GPU" in capsys.readouterr().err
