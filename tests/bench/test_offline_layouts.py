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

    from tandem.bench import offline_layouts
    from tandem.platform import machine

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False}
    (directory / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(machine, "matmul_flops_per_s", lambda *args: 1e12)
    monkeypatch.setattr(offline_layouts, "own_gemm_flops_per_s", lambda *args: 0.0)
    monkeypatch.setattr(machine, "memory_copy_bytes_per_s", lambda *args: 1e11)
    monkeypatch.setattr(machine, "memory_read_bytes_per_s", lambda *args: read)


# Llama-3.1-8B's attention: 32 query heads of 128 in 32 layers, q.k and p.v 2 x 128 FLOPs
# each a head; 8 KV heads of 128, a key and a value, bf16: 128 KiB of KV per token.
PAIR_FLOPS = 4 * 32 * 128 * 32
KV_TOKEN_BYTES = 2 * 8 * 128 * 32 * 2


def _llama_8b_step(tmp_path, contexts: list[int], read: float) -> float:
    """One decode step's bound at 1 TFLOP/s and `read` B/s: the weights and every running
    sequence's KV read, against the layers' and the attention's FLOPs."""
    from tandem.bench.offline_layouts import step_read_bytes

    per_token = 2 * 8.03e9
    reads = (step_read_bytes(tmp_path, "bfloat16", len(contexts)) + sum(contexts) * KV_TOKEN_BYTES) / read
    return max(reads, (len(contexts) * per_token + sum(contexts) * PAIR_FLOPS) / 1e12)


def test_prefill_ceiling_leaves_out_the_lm_head(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's logits are taken at its last token only: its other tokens cost the decoder
    layers' FLOPs, while the last one (which gives the first output token) and a decode step
    also pay for the LM head."""
    from tandem.bench.offline_layouts import machine_ceilings
    from tandem.bench.offline_workloads import Workload

    _llama_8b_on_fixed_rates(tmp_path, monkeypatch, read=2e11)
    workloads = {name: Workload(name, "batch", [[1] * 8] * 4, [1] * 4)
                 for name in ("prefill-heavy", "decode-heavy")}
    ceilings = machine_ceilings(tmp_path, "bfloat16", workloads)
    head = 2 * 128256 * 4096
    assert ceilings["flops_per_token"] == pytest.approx(2 * 8.03e9, rel=0.01)
    # and each prompt's 8 x 9 / 2 causal (query, key) pairs of attention
    seconds = (32 * (ceilings["flops_per_token"] - head) + 4 * head + 4 * 36 * PAIR_FLOPS) / 1e12
    assert ceilings["prefill-heavy"] == ("prompt_tok_s", pytest.approx(32 / seconds))
    assert ceilings["decode-heavy"] == ("output_tok_s", pytest.approx(4 / seconds))


def test_the_prefill_heavy_ceiling_counts_the_decode_steps_its_run_times(tmp_path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """prefill-heavy's prompt tok/s is its prompt tokens over the whole timed run, which
    decodes 16 tokens a prompt: the bound adds those steps' time, as decode-heavy's does."""
    from tandem.bench.offline_layouts import machine_ceilings
    from tandem.bench.offline_workloads import Workload

    _llama_8b_on_fixed_rates(tmp_path, monkeypatch, read=1e11)
    workload = Workload("prefill-heavy", "batch", [[1] * 8] * 4, [3] * 4)
    ceilings = machine_ceilings(tmp_path, "bfloat16", {"prefill-heavy": workload})
    per_token, head = ceilings["flops_per_token"], 2 * 128256 * 4096
    prefill = (32 * (per_token - head) + 4 * head + 4 * 36 * PAIR_FLOPS) / 1e12
    steps = sum(_llama_8b_step(tmp_path, [8 + step] * 4, 1e11) for step in (1, 2))
    assert ceilings["prefill-heavy"] == ("prompt_tok_s", pytest.approx(32 / (prefill + steps)))


def test_the_matmul_rate_is_the_faster_of_torch_s_and_tandem_s_own_gemm(tmp_path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the AMX Xeon tandem's packed GEMM ran at ~3.2 TFLOP/s against oneDNN's ~2.5: a
    ceiling from oneDNN's rate alone was passed by tandem's own linears."""
    from tandem.bench import offline_layouts
    from tandem.bench.offline_workloads import Workload

    _llama_8b_on_fixed_rates(tmp_path, monkeypatch, read=2e11)
    workloads = {"prefill-heavy": Workload("prefill-heavy", "batch", [[1] * 8] * 4, [1] * 4)}
    slower = offline_layouts.machine_ceilings(tmp_path, "bfloat16", workloads)
    monkeypatch.setattr(offline_layouts, "own_gemm_flops_per_s", lambda *args: 3e12)
    faster = offline_layouts.machine_ceilings(tmp_path, "bfloat16", workloads)
    assert slower["matmul_flops_per_s"] == 1e12 and faster["matmul_flops_per_s"] == 3e12
    assert faster["prefill-heavy"][1] == pytest.approx(3 * slower["prefill-heavy"][1])


def test_the_matmul_rate_is_measured_on_the_model_s_layers_too(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMMs ran SmolLM2's K = 576 layers faster than 2,048^3: the rate is the best over
    the square and the model's q/k/v, o, gate/up and down at 2,048 rows."""
    from tandem.bench import offline_layouts
    from tandem.bench.offline_workloads import Workload
    from tandem.platform import machine

    _llama_8b_on_fixed_rates(tmp_path, monkeypatch, read=2e11)
    measured: list[tuple[int, int, int]] = []

    def rate(dtype: str, m: int, k: int, n: int) -> float:
        measured.append((m, k, n))
        return 2e12 if (k, n) == (14336, 4096) else 1e12

    monkeypatch.setattr(machine, "matmul_flops_per_s", rate)
    workloads = {"prefill-heavy": Workload("prefill-heavy", "batch", [[1] * 8] * 4, [1] * 4)}
    ceilings = offline_layouts.machine_ceilings(tmp_path, "bfloat16", workloads)
    assert measured == [(2048, 2048, 2048), (2048, 4096, 4096 + 2 * 1024), (2048, 4096, 4096),
                        (2048, 4096, 2 * 14336), (2048, 14336, 4096)]
    assert ceilings["matmul_flops_per_s"] == 2e12


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
    prefill = (38 * (per_token - head) + 5 * head + (4 * 36 + 21) * PAIR_FLOPS) / 1e12
    # step 1: the four 8-token prompts and the 6-token one, each with its first output token
    steps = [_llama_8b_step(tmp_path, [9] * 4 + [7], 1e11), _llama_8b_step(tmp_path, [10] * 4, 1e11)]
    assert ceilings["decode-heavy"] == ("output_tok_s", pytest.approx(14 / (prefill + sum(steps))))
    # these steps are read-bound (15 GB at 100 GB/s against 5 x 16 GFLOP at 1 TFLOP/s)
    assert steps[0] == pytest.approx((step_read_bytes(tmp_path, "bfloat16", 5) + 43 * KV_TOKEN_BYTES) / 1e11)


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
    from tandem.bench import offline_layouts
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
    monkeypatch.setattr(offline_layouts, "own_gemm_flops_per_s", lambda *args: 0.0)
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


def test_the_batch_ceilings_count_attention_s_kv_reads_and_flops(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """16 sequences of 4,096 tokens: a decode step reads 8.6 GB of KV beside 16 GB of
    weights (at 50 GB/s it is read-bound), and a prompt's causal attention is 7% of its FLOPs:
    a bound without them would be 1.5x high on the step; the ceiling counts both."""
    from tandem.bench.offline_layouts import machine_ceilings, step_read_bytes
    from tandem.bench.offline_workloads import Workload

    _llama_8b_on_fixed_rates(tmp_path, monkeypatch, read=5e10)
    workload = Workload("decode-heavy", "batch", [[1] * 4096] * 16, [2] * 16)
    ceilings = machine_ceilings(tmp_path, "bfloat16", {"decode-heavy": workload})
    per_token, head = ceilings["flops_per_token"], 2 * 128256 * 4096
    pairs = 4096 * 4097 // 2
    prefill = 16 * (4096 * (per_token - head) + head + pairs * PAIR_FLOPS) / 1e12
    step = (step_read_bytes(tmp_path, "bfloat16", 16) + 16 * 4097 * KV_TOKEN_BYTES) / 5e10
    assert step == pytest.approx(_llama_8b_step(tmp_path, [4097] * 16, 5e10))  # read-bound
    assert ceilings["decode-heavy"] == ("output_tok_s", pytest.approx(32 / (prefill + step)))
    assert step > 1.5 * step_read_bytes(tmp_path, "bfloat16", 16) / 5e10


def test_mla_attention_is_counted_on_the_latent_in_decode_and_expanded_in_a_prompt() -> None:
    """K2.5-mini's MLA: a prompt's (query, key) pair is q.k over nope + rope and p.v over
    v_head_dim per head; a decode step's is over the latent (kv_lora_rank + rope, then
    kv_lora_rank), the up-projections absorbed, as its cache holds only the latent."""
    import json

    from tandem.bench.offline_layouts import AttentionWork
    from tandem.sizing.examples import EXAMPLES_DIR
    from tandem.sizing.shape import read_shape

    shape = read_shape(json.loads((EXAMPLES_DIR / "kimi-k2.5-mini" / "config.json").read_text()))
    mla = shape.mla
    work = AttentionWork.of(shape, 1e-9)
    heads, layers = shape.num_heads, shape.num_layers
    assert work.prefill_flops_per_pair == 2 * heads * layers * (
        mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)
    assert work.decode_flops_per_pair == 2 * heads * layers * (2 * mla.kv_lora_rank + mla.qk_rope_head_dim)
    assert work.kv_read_seconds_per_token == 1e-9


def test_a_mode_s_own_limits_count_the_bytes_its_steps_read_and_its_int8_rate(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tandem's default mode reads a 4-bit copy at one and two tokens and multiplies larger
    steps in 8 bits: its own limits count those bytes and the int8 linear's rate, beside the
    dtype's limits every engine shares; an engine that reports nothing gets the dtype's."""
    from tandem.bench import offline_layouts
    from tandem.bench.offline_layouts import format_ceilings, machine_ceilings, reported_step_reads
    from tandem.bench.offline_workloads import Workload

    _llama_8b_on_fixed_rates(tmp_path, monkeypatch, read=1e11)
    monkeypatch.setattr(offline_layouts, "own_int8_flops_per_s", lambda *args: 4e12)
    single = Workload("single-stream", "single", [[1] * 8], [9])
    # a one-token step of 4 prompts of 8 tokens, 3 output tokens each: steps of 4 sequences
    batch = Workload("decode-heavy", "batch", [[1] * 8] * 4, [3] * 4)
    reads = {"up_to": [[2, 4e9], [3, 8e9]], "gemm": "int8"}
    results = {name: {"tandem": {"ok": True, "engine_info": {"step_reads": reads}, metric: value},
                      "vllm": {"ok": True, metric: value}}
               for name, metric, value in (("single-stream", "decode_tok_s", 10.0),
                                           ("decode-heavy", "output_tok_s", 20.0))}
    assert reported_step_reads(results) == {"tandem": reads}
    ceilings = machine_ceilings(tmp_path, "bfloat16", {"single-stream": single, "decode-heavy": batch},
                                own=reported_step_reads(results))
    own = ceilings["own"]["tandem"]
    assert own["single-stream"] == pytest.approx(1e11 / 4e9)  # 25 tok/s: the 4-bit copy at the read rate
    assert ceilings["single-stream"][1] == pytest.approx(1e11 / offline_layouts.step_read_bytes(tmp_path, "bfloat16", 1))
    per_token, head = ceilings["flops_per_token"], 2 * 128256 * 4096
    # the layers at the int8 rate, attention's products (over bf16 keys and values) at bf16's
    prefill = (32 * (per_token - head) + 4 * head) / 4e12 + 4 * 36 * PAIR_FLOPS / 1e12
    # two steps of 4 sequences (> 2 tokens: the 8-bit weights), each bounded by its reads
    steps = sum(max((8e9 + 4 * (8 + step) * KV_TOKEN_BYTES) / 1e11,
                    4 * per_token / 4e12 + 4 * (8 + step) * PAIR_FLOPS / 1e12) for step in (1, 2))
    assert own["decode-heavy"] == pytest.approx(12 / (prefill + steps))
    text = format_ceilings(ceilings, results, ["tandem", "vllm"])
    assert "tandem's own mode: a one-token step reads 4,000 MB" in text and "8-bit (int8) at 4,000 GFLOP/s" in text
    assert f"tandem's own mode <= 25: {100 * 10 / 25:.0f}%" in text
    # a mode whose larger steps multiply in the dtype is bounded by the dtype's rate
    bf16 = machine_ceilings(tmp_path, "bfloat16", {"decode-heavy": batch},
                            own={"tandem": {"up_to": [[2, 4e9], [3, 8e9]], "gemm": "bfloat16"}})
    assert bf16["own"]["tandem"]["matmul_flops_per_s"] == 1e12
