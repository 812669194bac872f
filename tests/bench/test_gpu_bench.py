"""`tandem bench gpu` without a GPU: its arithmetic, its shipped config, and a clear refusal.
The measurement itself needs a GPU (see the README's GPU section for how it ran)."""

from __future__ import annotations

import json

import pytest

from tandem.bench.gpu import CONFIGS, config_path, weight_shape
from tandem.cli.main import main


def test_llama_8b_config_has_8b_parameters() -> None:
    shape = weight_shape(json.loads(config_path("llama-3.1-8b").read_text()))
    assert shape["params"] == 8_030_261_248 - 2 * 32 * 4096 - 4096  # HF's count, less the norms
    assert shape["matmul_params"] == shape["params"] - 128256 * 4096
    assert (shape["layers"], shape["heads"], shape["kv_heads"], shape["head_dim"]) == (32, 32, 8, 128)


def test_config_names_and_files(tmp_path) -> None:
    assert config_path("llama-3.1-8b") == CONFIGS / "llama-3.1-8b.json"
    own = tmp_path / "config.json"
    own.write_text("{}")
    assert config_path(str(own)) == own
    with pytest.raises(ValueError, match="llama-3.1-8b"):
        config_path("no-such-model")


def test_refuses_without_a_gpu(capsys) -> None:
    assert main(["bench", "gpu", "--no-transformers"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


@pytest.mark.parametrize(("kv", "row_bytes", "peer"), [("auto", 2 * 64, "auto"), ("int8", 64 + 4, "fp8")])
def test_kv_room_beside_vllm_and_a_contiguous_cache(tmp_path, capsys, kv: str, row_bytes: int, peer: str) -> None:
    """The bench's KV line on a small dummy bf16 model here (the GPU's total passed in): the
    tokens as allocated, their bytes as the plan counts them, and vLLM beside it in the same
    KV dtype, or in fp8 for int8, which vLLM has not."""
    from tandem.bench.gpu import kv_room
    from tandem.llm import LLM

    config = json.loads(config_path("llama-3.1-8b").read_text())
    config.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=1024)
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=512,
              kv_cache_dtype=kv, block_size=16)  # a GPU's default block
    try:
        room = kv_room(llm, config, 512, 256, 80 << 30, kv)
    finally:
        llm.shutdown()
    kv_per_token = 2 * 2 * 2 * row_bytes  # K and V, 2 layers, 2 heads, a row each
    assert room["kv_bytes_per_token"] == kv_per_token
    assert room["tandem_tokens"] == 8 * 2**20 // (kv_per_token * 16) * 16
    assert room["paged_sequences"] == room["tandem_tokens"] // 256
    assert room["contiguous_sequences"] == room["tandem_tokens"] // 512
    assert room["vllm_kv_cache_dtype"] == peer and room["vllm_default_tokens"] > 0
    assert room["tandem_planned_tokens"] > room["tandem_tokens"]  # 80 GiB planned, 8 MiB given
    assert f"vLLM's defaults here in {peer} (planned)" in capsys.readouterr().out


def test_kv_cache_dtypes_are_checked_at_parse_time(capsys) -> None:
    for bad in ("int4", "fp8,fp8", ""):
        with pytest.raises(SystemExit) as exited:
            main(["bench", "gpu", "--kv-cache-dtypes", bad])
        assert exited.value.code == 2
        assert "--kv-cache-dtypes" in capsys.readouterr().err


def test_an_unknown_config_fails_at_parse_time(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "gpu", "--config", "no-such-model"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("tandem: error: --config no-such-model: no such file")


def test_int4_moe_refuses_without_a_gpu(capsys) -> None:
    assert main(["bench", "gpu", "--int4-moe"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_int4_moe_active_experts_checked_at_parse_time(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "gpu", "--int4-moe", "--moe-active-experts", "0"])
    assert exited.value.code == 2
    assert "--moe-active-experts 0: at least 1" in capsys.readouterr().err


def test_int4_moe_cases_are_kimi_k25_experts_on_one_of_8_gpus() -> None:
    from tandem.bench.gpu import MOE_CONFIG, MoeCase, int4_moe_cases
    from tandem.sizing.examples import load_config

    cases = int4_moe_cases(load_config(MOE_CONFIG)[1])
    assert cases == [
        MoeCase("TP 8", "w13 + silu", 384, 512, 7168, True), MoeCase("TP 8", "w13", 384, 512, 7168, False),
        MoeCase("TP 8", "w2", 384, 7168, 256, False),
        MoeCase("EP 8", "w13 + silu", 48, 4096, 7168, True), MoeCase("EP 8", "w13", 48, 4096, 7168, False),
        MoeCase("EP 8", "w2", 48, 7168, 2048, False),
    ]
    assert [c.width for c in cases] == [256, 512, 7168, 2048, 4096, 7168]


def test_int4_moe_bytes_and_the_copy_bound() -> None:
    """Half a byte a weight, a bf16 scale per 32, the rows in and out; the share of the bound
    at the measured and the nominal bandwidth."""
    from tandem.bench.gpu import MoeCase, int4_moe_bytes, moe_figures, nominal_hbm_gb_s

    w13 = MoeCase("EP 8", "w13 + silu", 48, 4096, 7168, True)
    moved = int4_moe_bytes(w13, active=8, rows=2)
    weights = 8 * (4096 * 7168 // 2 + 4096 * 224 * 2)
    assert moved == {"weight_bytes": weights, "bytes": weights + 16 * 7168 * 2 + 16 * 2048 * 2}
    assert weights == 8 * 4096 * 7168 * 0.5625  # 4.5 bits a weight
    figures = moe_figures(20e-6, {"weight_bytes": 0, "bytes": 60_000_000}, copy_gb_s=4000.0, nominal_gb_s=4800.0)
    assert figures["bound_us"] == pytest.approx(15.0)
    assert figures["of_bound"] == pytest.approx(0.75)
    assert figures["of_nominal"] == pytest.approx(0.625)
    assert figures["gb_s"] == pytest.approx(3000.0)
    assert "of_nominal" not in moe_figures(1.0, {"weight_bytes": 0, "bytes": 1}, 1.0, None)
    assert nominal_hbm_gb_s("NVIDIA H200") == 4800.0
    assert nominal_hbm_gb_s("NVIDIA H100 80GB HBM3") == 3350.0
    assert nominal_hbm_gb_s("NVIDIA H100 PCIe") == 2000.0
    assert nominal_hbm_gb_s("NVIDIA A10G") is None


def test_int4_moe_active_experts_spread_over_the_stack() -> None:
    from tandem.bench.gpu import active_offsets

    offsets = active_offsets(48, 8, 3)
    counts = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert len(offsets) == 49 and offsets[-1] == 24
    assert [e for e, c in enumerate(counts) if c] == [0, 6, 12, 18, 24, 30, 36, 42]
    assert set(counts) == {0, 3}
    assert active_offsets(4, 4, 1) == [0, 1, 2, 3, 4]


def test_results_record_the_arguments_as_json() -> None:
    """results.json gets the parsed flags; the handler and check functions beside them in the
    namespace would make json.dumps fail at the end of a GPU run."""
    from tandem.bench.gpu import recorded_args
    from tandem.cli.main import build_parser

    args = build_parser().parse_args(["bench", "gpu", "--int4-moe", "--moe-active-experts", "4"])
    recorded = json.loads(json.dumps(recorded_args(args)))
    assert recorded["int4_moe"] is True and recorded["moe_active_experts"] == 4
    assert "handler" not in recorded and "check" not in recorded
