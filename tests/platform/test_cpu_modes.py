"""The CPU's default mode, table-driven: what `--dtype`, `--quantization` and `--decode-weights
auto` become for each instruction set, checkpoint and layout, and `--exact`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tandem.config import EngineConfig, KVTransferConfig, LoadConfig, ParallelConfig
from tandem.platform.cpu_modes import (
    DEFAULT_MODE_ENV,
    CpuFeatures,
    choose_cpu_mode,
    is_quantized_checkpoint,
)

AVX2 = "fpu sse2 avx avx2 fma f16c"
AVX512 = f"{AVX2} avx512f avx512bw avx512vl"
SAPPHIRE_RAPIDS = f"{AVX512} avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8"
ZEN4 = f"{AVX512} avx512_vnni avx512_bf16"
CASCADE_LAKE = f"{AVX512} avx512_vnni"
SKYLAKE = AVX512
NONE = "fpu sse2"

# flags, quantized checkpoint -> (dtype, quantization, decode weights)
TABLE = [
    (SAPPHIRE_RAPIDS, True, ("bfloat16", "none", "int4")),  # AMX's bf16 tiles beat its int8 path
    (SAPPHIRE_RAPIDS, False, ("bfloat16", "none", "int4")),
    (ZEN4, True, ("bfloat16", "int8", "int4")),
    (ZEN4, False, ("bfloat16", "none", "int4")),
    (CASCADE_LAKE, True, ("float32", "int8", "int4")),
    (SKYLAKE, True, ("float32", "none", "int4")),
    (AVX2, True, ("float32", "none", "int4")),
    (NONE, True, ("float32", "none", "none")),
]


@pytest.mark.parametrize(("flags", "quantized", "want"), TABLE)
def test_each_cpu_gets_the_parts_its_instructions_run(flags: str, quantized: bool, want: tuple[str, ...]) -> None:
    mode = choose_cpu_mode(CpuFeatures.from_flags(flags.split()), quantized)
    assert (mode.dtype, mode.quantization, mode.decode_weights) == want
    assert "--exact" in mode.note and mode.dtype in mode.note


@pytest.mark.parametrize(("flags", "quantized", "want"), TABLE)
def test_exact_and_split_models_take_no_compact_weights(flags: str, quantized: bool, want: tuple[str, ...]) -> None:
    """--exact reads the checkpoint's own fp32 rows at one token where the GEMV kernel's vector
    path runs (no rounding: not a compact copy); a split model or a prefill worker none."""
    features = CpuFeatures.from_flags(flags.split())
    exact = choose_cpu_mode(features, quantized, exact=True)
    rows = "float32" if flags != NONE else "none"
    assert (exact.dtype, exact.quantization, exact.decode_weights) == ("float32", "none", rows)
    for apart in ({"one_rank": False}, {"decodes": False}):
        exact_apart = choose_cpu_mode(features, quantized, exact=True, **apart)
        assert (exact_apart.dtype, exact_apart.quantization, exact_apart.decode_weights) == ("float32", "none", "none")
    split = choose_cpu_mode(features, quantized, one_rank=False)
    assert (split.dtype, split.quantization, split.decode_weights) == (want[0], "none", "none")


def test_features_come_from_the_cpuinfo_flags_line(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: {SAPPHIRE_RAPIDS}\n\nprocessor\t: 1\n")
    features = CpuFeatures.detect(cpuinfo)
    assert features.amx and features.native_bf16 and not features.int8_fastest and features.describe() == "AMX"
    assert CpuFeatures.detect(tmp_path / "absent") == CpuFeatures()
    assert CpuFeatures.from_flags(CASCADE_LAKE.split()).describe() == "AVX-512 (VNNI)"
    assert CpuFeatures.from_flags(AVX2.split()).describe() == "AVX2"


def test_a_gguf_checkpoint_its_conversion_or_an_alias_counts_as_quantized(tmp_path: Path) -> None:
    from tandem.loader.resolve import ALIASES

    assert ALIASES and all(is_quantized_checkpoint(alias) for alias in ALIASES)  # each names a GGUF file
    gguf = tmp_path / "model.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    assert is_quantized_checkpoint(str(gguf))
    converted = tmp_path / "converted"
    converted.mkdir()
    assert not is_quantized_checkpoint(str(converted))  # an HF directory of full-precision weights
    (converted / "tandem_source.json").write_text("{}")
    assert is_quantized_checkpoint(str(converted))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert not is_quantized_checkpoint(str(tmp_path / "model.safetensors"))


def _settled(monkeypatch: pytest.MonkeyPatch, flags: str, load: LoadConfig | None = None,
             parallel: ParallelConfig | None = None, role: str = "both") -> LoadConfig:
    monkeypatch.delenv(DEFAULT_MODE_ENV, raising=False)
    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls, *a: cls.from_flags(flags.split())))
    config = EngineConfig("smollm2-135m", load=load or LoadConfig(device="cpu"), parallel=parallel or ParallelConfig(),
                          kv_transfer=KVTransferConfig(role=role))
    return config.load


def test_the_engine_config_settles_auto_and_keeps_what_was_set(monkeypatch: pytest.MonkeyPatch) -> None:
    load = _settled(monkeypatch, ZEN4)
    assert (load.dtype, load.quantization, load.decode_weights) == ("bfloat16", "int8", "int4")
    assert load.mode_line().startswith("bfloat16 + int8 GEMMs + int4 decode weights (AVX-512 (BF16+VNNI);")
    given = _settled(monkeypatch, ZEN4, LoadConfig(device="cpu", dtype="bfloat16"))  # as a CLI settles auto
    assert (given.dtype, given.quantization, given.decode_weights) == ("bfloat16", "int8", "int4")
    assert given.mode_line() == load.mode_line()
    fp32 = _settled(monkeypatch, ZEN4, LoadConfig(device="cpu", dtype="float32"))
    assert (fp32.dtype, fp32.quantization, fp32.decode_weights) == ("float32", "int8", "int4")
    assert fp32.mode_line() == "float32, quantization int8 (auto), decode weights int4 (auto)"
    plain = _settled(monkeypatch, ZEN4, LoadConfig(device="cpu", dtype="float32", quantization="none",
                                                   decode_weights="none"))
    assert plain.mode_line() == "exact fp32 (token-identical to transformers) (as set)"
    mixed = _settled(monkeypatch, ZEN4, LoadConfig(device="cpu", decode_weights="bfloat16"))
    assert (mixed.dtype, mixed.quantization, mixed.decode_weights) == ("bfloat16", "int8", "bfloat16")
    assert mixed.mode_line() == "bfloat16 (auto), quantization int8 (auto), decode weights bfloat16"
    exact = _settled(monkeypatch, SAPPHIRE_RAPIDS, LoadConfig(device="cpu", exact=True))
    assert (exact.dtype, exact.quantization, exact.decode_weights) == ("float32", "none", "float32")
    assert exact.mode_line() == "exact fp32 (token-identical to transformers)"
    one_copy = _settled(monkeypatch, SAPPHIRE_RAPIDS, LoadConfig(device="cpu", exact=True, decode_weights="none"))
    assert one_copy.decode_weights == "none" and one_copy.mode_line() == exact.mode_line()
    tp2 = _settled(monkeypatch, ZEN4, parallel=ParallelConfig.of(2, 2, "mp"))
    assert (tp2.quantization, tp2.decode_weights) == ("none", "none")
    assert replace(load).quantization == "int8"  # settled once; a copy stays settled


@pytest.mark.parametrize(("flags", "quantized", "want"), TABLE)
def test_a_prefill_worker_takes_no_decode_copy(flags: str, quantized: bool, want: tuple[str, ...]) -> None:
    """Its steps are whole prompts: a 4-bit copy would be built and never read."""
    prefill = choose_cpu_mode(CpuFeatures.from_flags(flags.split()), quantized, decodes=False)
    assert (prefill.dtype, prefill.quantization, prefill.decode_weights) == (*want[:2], "none")


def test_the_engine_config_of_a_prefill_worker_settles_no_decode_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    prefill = _settled(monkeypatch, ZEN4, role="prefill")
    assert (prefill.dtype, prefill.quantization, prefill.decode_weights) == ("bfloat16", "int8", "none")
    assert "a prefill worker reads no decode copy" in prefill.mode_line()
    decode = _settled(monkeypatch, ZEN4, role="decode")
    assert decode.decode_weights == "int4"
    given = _settled(monkeypatch, ZEN4, LoadConfig(device="cpu", decode_weights="int4"), role="prefill")
    assert given.decode_weights == "int4"  # a flag is kept


def test_the_exact_environment_makes_auto_the_exact_path(monkeypatch: pytest.MonkeyPatch) -> None:
    _settled(monkeypatch, SAPPHIRE_RAPIDS)
    monkeypatch.setenv(DEFAULT_MODE_ENV, "exact")
    load = EngineConfig("smollm2-135m", load=LoadConfig(device="cpu")).load
    assert (load.dtype, load.quantization, load.decode_weights) == ("float32", "none", "float32")


def test_exact_rows_are_an_fp32_models_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `auto` meaning exact (the test suite's environment), a model given another dtype
    takes no fp32 rows (--decode-weights float32 keeps an fp32 model's own)."""
    _settled(monkeypatch, SAPPHIRE_RAPIDS)
    monkeypatch.setenv(DEFAULT_MODE_ENV, "exact")
    for dtype, rows in (("bfloat16", "none"), ("float32", "float32")):
        load = EngineConfig("smollm2-135m", load=LoadConfig(device="cpu", dtype=dtype)).load
        assert (load.dtype, load.decode_weights) == (dtype, rows)


def test_exact_refuses_a_lossy_setting_beside_it() -> None:
    for change in ({"dtype": "bfloat16"}, {"quantization": "int8"}, {"decode_weights": "int4"}):
        with pytest.raises(ValueError, match="--exact is the fp32 path"):
            LoadConfig(device="cpu", exact=True, **change)


def test_tandem_serve_with_the_prefill_role_settles_no_decode_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The role reaches the default mode through the command line (tandem up's workers)."""
    from tandem.cli.main import build_parser
    from tandem.flags.engine import serve_engine_config
    from tandem.trust.keys import CLUSTER_SECRET_ENV

    monkeypatch.delenv(DEFAULT_MODE_ENV, raising=False)
    monkeypatch.setenv(CLUSTER_SECRET_ENV, "a-test-secret")
    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls, *a: cls.from_flags(ZEN4.split())))
    for role, decode_weights in (("prefill", "none"), ("decode", "int4"), ("both", "int4")):
        argv = ["serve", "smollm2-135m", "--role", role, "--device", "cpu"]
        config = serve_engine_config(build_parser(argv).parse_args(argv))
        assert (config.kv_transfer.role, config.load.decode_weights) == (role, decode_weights)
