"""`tandem bench offline --layouts`: layout names, and the step breakdown's arithmetic."""

from __future__ import annotations

import json

import pytest

from tandem.bench.offline_layouts import (
    BREAKDOWN_COLUMNS,
    format_breakdown_table,
    mean_breakdown,
    parse_layout,
)


@pytest.mark.parametrize("name, expected", [
    ("tp1", (1, 1, False)),
    ("tp2", (2, 1, False)),
    ("pp2", (1, 2, False)),
    ("ep2", (2, 1, True)),
    ("tp2+ep2", (2, 1, True)),
    ("tp2+pp2", (2, 2, False)),
])
def test_layout_names(name: str, expected: tuple[int, int, bool]) -> None:
    got = parse_layout(name)
    assert (got["tensor_parallel_size"], got["pipeline_parallel_size"], got["enable_expert_parallel"]) == expected


@pytest.mark.parametrize("name", ["tp", "dp2", "tp0", "tp2+ep4"])
def test_bad_layout_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="layout"):
        parse_layout(name)


def test_the_breakdown_is_a_partition_of_the_mean_step() -> None:
    rank0 = {"step": 100.0, "steps": 10, "attention": 30.0, "moe.route": 5.0, "moe.experts": 40.0,
             "moe.dispatch": 4.0, "moe.combine": 4.0, "moe.gather": 2.0, "tp.all_reduce": 5.0, "other": 10.0}
    rank1 = {**rank0, "step": 120.0, "other": 30.0}
    mean = mean_breakdown([rank0, rank1])
    assert mean["step_ms"] == pytest.approx(11.0)  # 110 ms over 10 steps
    assert sum(mean[label] for label, _ in BREAKDOWN_COLUMNS) == pytest.approx(100.0)
    assert mean["all-to-all"] == pytest.approx(100 * 10 / 110)
    results = {"decode-heavy": {"tandem@ep2": {"ok": True, "profile": [rank0, rank1]}}}
    assert "decode-heavy" in format_breakdown_table(results, ["tandem@ep2"])


def _llama_8b_on_fixed_rates(directory, monkeypatch: pytest.MonkeyPatch, read: float) -> None:
    """Llama-3.1-8B's config.json in `directory` (8.03B parameters, of which the LM head is
    128256 x 4096 = 0.525B), on a machine measured at 1 TFLOP/s, 100 GB/s copy, `read` B/s."""
    import json

    from tandem.platform import machine

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False}
    (directory / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(machine, "matmul_flops_per_s", lambda *args: 1e12)
    monkeypatch.setattr(machine, "memory_copy_bytes_per_s", lambda *args: 1e11)
    monkeypatch.setattr(machine, "memory_read_bytes_per_s", lambda *args: read)


def test_prefill_ceiling_leaves_out_the_lm_head(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's logits are taken at its last token only: its other tokens cost the decoder
    layers' FLOPs, while a decode step also pays for the LM head."""
    from tandem.bench.offline_layouts import machine_ceilings
    from tandem.bench.offline_workloads import Workload

    _llama_8b_on_fixed_rates(tmp_path, monkeypatch, read=2e11)
    workloads = {name: Workload(name, "batch", [[1] * 8] * 4, [1] * 4)
                 for name in ("prefill-heavy", "decode-heavy")}
    ceilings = machine_ceilings(tmp_path, "bfloat16", workloads)
    head = 128256 * 4096
    assert ceilings["flops_per_token"] == pytest.approx(2 * 8.03e9, rel=0.01)
    assert ceilings["prefill-heavy"] == ("prompt_tok_s", pytest.approx(1e12 / (ceilings["flops_per_token"] - 2 * head)))
    assert ceilings["prefill-heavy"][1] == pytest.approx(1e12 / (2 * 7.50e9), rel=0.01)


def test_the_decode_heavy_ceiling_counts_the_prefill_the_run_times(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch run's output tok/s is timed from its first prefill: the ceiling adds the
    prompts' FLOPs (and the LM head once a prompt, for the first token) to a step for every
    further token, each step bounded by its weight read or its FLOPs."""
    from tandem.bench.offline_layouts import machine_ceilings, step_read_bytes
    from tandem.bench.offline_workloads import Workload

    _llama_8b_on_fixed_rates(tmp_path, monkeypatch, read=1e11)
    # 4 prompts of 8 tokens, 3 output tokens each; a 6-token request joins for its first 2
    workload = Workload("decode-heavy", "batch", [[1] * 8] * 4 + [[1] * 6], [3] * 4 + [2])
    ceilings = machine_ceilings(tmp_path, "bfloat16", {"decode-heavy": workload})
    per_token = ceilings["flops_per_token"]
    head = 2 * 128256 * 4096
    prefill = (38 * (per_token - head) + 5 * head) / 1e12
    steps = [max(step_read_bytes(tmp_path, "bfloat16", batch) / 1e11, batch * per_token / 1e12) for batch in (5, 4)]
    assert ceilings["decode-heavy"] == ("output_tok_s", pytest.approx(14 / (prefill + sum(steps))))
    # these steps are read-bound (15 GB at 100 GB/s against 5 x 16 GFLOP at 1 TFLOP/s)
    assert steps[0] == pytest.approx(step_read_bytes(tmp_path, "bfloat16", 5) / 1e11)


def test_a_dense_experts_layout_runs_the_config_without_its_int4_scheme() -> None:
    """`tp1+dense-experts` is the INT4 model's own shapes with the experts in the run dtype:
    its config loses quantization_config (both levels) and nothing else, and the ceilings
    count its bytes, 2.2x the packed model's on K2.5's shapes."""
    import json

    from tandem.bench.offline_layouts import (
        dense_experts_config,
        parse_layout,
        stored_weight_bytes,
        wants_dense_experts,
    )
    from tandem.sizing.examples import EXAMPLES_DIR

    mini = EXAMPLES_DIR / "kimi-k2.5-mini"
    assert parse_layout("tp1+dense-experts") == parse_layout("tp1")
    assert wants_dense_experts("tp2+dense-experts") and not wants_dense_experts("tp2")
    dense = dense_experts_config(mini)
    original, stripped = (json.loads((d / "config.json").read_text()) for d in (mini, dense))
    assert "quantization_config" not in stripped and "quantization_config" not in stripped["text_config"]
    original.pop("quantization_config")
    original["text_config"].pop("quantization_config")
    assert stripped == original
    packed, widened = stored_weight_bytes(mini, "bfloat16"), stored_weight_bytes(dense, "bfloat16")
    assert 2.0 < widened / packed < 2.4


def test_a_dense_experts_layout_needs_dummy_weights() -> None:
    import argparse

    from tandem.bench.offline import select_runs

    args = argparse.Namespace(layouts="tp1,tp1+dense-experts", engines=None, load_format="auto",
                              workloads="decode-heavy", scale=1.0)
    with pytest.raises(ValueError, match="needs --load-format dummy"):
        select_runs(args)


def test_bf16_without_a_bf16_matmul_is_bounded_by_the_fp32_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an AVX2-only CPU torch's bf16 matmul is an emulation (~0.1 GFLOP/s) while tandem's
    kernels widen bf16 to fp32: the fp32 rate bounds the step, and at 16 sequences a step on
    such a rate both K2.5-mini layouts are compute-bound (the same FLOPs), not read-bound."""
    from tandem.bench.offline_layouts import (
        dense_experts_config,
        format_ceilings,
        machine_ceilings,
        step_read_bytes,
    )
    from tandem.bench.offline_workloads import Workload
    from tandem.platform import machine
    from tandem.sizing.examples import EXAMPLES_DIR

    rates = {"bfloat16": 1e8, "float32": 6e10}
    monkeypatch.setattr(machine, "matmul_flops_per_s", lambda dtype="float32", *args: rates[dtype])
    monkeypatch.setattr(machine, "memory_copy_bytes_per_s", lambda *args: 1e10)
    monkeypatch.setattr(machine, "memory_read_bytes_per_s", lambda *args: 2e10)
    mini = EXAMPLES_DIR / "kimi-k2.5-mini"
    # a prompt of one token (its prefill left out of the bound: no LM head at a prompt token),
    # then 16 sequences x 100 decode steps: close to 100 x the compute-bound step
    workloads = {"decode-heavy": Workload("decode-heavy", "batch", [[1]] * 16, [101] * 16)}
    ceilings = machine_ceilings(mini, "bfloat16", workloads, {"tp1+dense-experts": dense_experts_config(mini)})
    assert ceilings["compute_dtype"] == "float32" and ceilings["matmul_flops_per_s"] == 6e10
    compute = 6e10 / ceilings["flops_per_token"]
    assert ceilings["decode-heavy"][1] == pytest.approx(compute, rel=0.02)
    assert ceilings["by_layout"]["tp1+dense-experts"]["decode-heavy"] == pytest.approx(ceilings["decode-heavy"][1])
    assert "no bf16 matmul here" in format_ceilings(ceilings, {}, [])
    # an fp32 run says its rate is fp32's, not that bf16 was widened
    fp32_run = machine_ceilings(mini, "float32", workloads)
    assert "in fp32" in format_ceilings(fp32_run, {}, []) and "no bf16" not in format_ceilings(fp32_run, {}, [])
    # one sequence a step reads more than it multiplies: the read rate, not the copy rate
    single = {"decode-heavy": Workload("decode-heavy", "batch", [[1]], [101])}
    assert machine_ceilings(mini, "bfloat16", single)["decode-heavy"][1] == pytest.approx(
        2e10 / step_read_bytes(mini, "bfloat16", 1), rel=0.02)


def test_a_decode_step_reads_the_experts_its_tokens_chose() -> None:
    """K2.5-mini, 8 of 48 experts a token: one sequence reads a sixth of the routed experts,
    16 sequences ~95% of them (uniform choices); the untied input embedding is not read."""
    from tandem.bench.offline_layouts import (
        dense_experts_config,
        step_read_bytes,
        stored_weight_bytes,
    )
    from tandem.sizing.examples import EXAMPLES_DIR
    from tandem.sizing.shape import read_shape

    mini = EXAMPLES_DIR / "kimi-k2.5-mini"
    dense = dense_experts_config(mini)
    shape = read_shape(json.loads((mini / "config.json").read_text()))
    embedding = shape.vocab_size * shape.hidden_size * 2
    experts = stored_weight_bytes(dense, "bfloat16") - stored_weight_bytes(mini, "bfloat16")  # 3/4 of bf16's
    bf16_experts = experts / (1 - 0.5625 / 2)  # packed INT4: half a byte a weight and a bf16 scale per 32
    rest = stored_weight_bytes(dense, "bfloat16") - bf16_experts - embedding
    assert step_read_bytes(dense, "bfloat16", 1) == pytest.approx(rest + bf16_experts * 8 / 48, rel=1e-6)
    chosen = 1 - (40 / 48) ** 16
    assert 0.94 < chosen < 0.96
    assert step_read_bytes(dense, "bfloat16", 16) == pytest.approx(rest + bf16_experts * chosen, rel=1e-6)
    # (the packed tensors carry a few bytes more: their shapes)
    assert step_read_bytes(mini, "bfloat16", 1) == pytest.approx(rest + bf16_experts * 0.5625 / 2 * 8 / 48, rel=1e-5)
