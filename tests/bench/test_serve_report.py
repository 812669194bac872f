"""`tandem bench serve` report (percentiles, metrics, table, JSON, PNG) and the command's
plumbing (targets, server commands, launching and stopping a server process)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from tandem.bench.load_client import RequestRecord, RunResult, TrafficConfig
from tandem.bench.serve import (
    LaunchedServer,
    Target,
    add_serve_parser,
    free_port,
    goal_line,
    parse_url_target,
    plan_targets,
    tandem_command,
    traffic_config,
    vllm_command,
    vllm_env,
    workload_config,
)
from tandem.bench.serve_report import (
    SCHEMA,
    TargetOutcome,
    build_report,
    compute_metrics,
    format_table,
    percentile,
    plot,
    ratio,
    ratio_rows,
    reusable_tokens,
)


def _rec(
    ttft: float,
    e2e: float,
    itl: list[float],
    prompt: int = 100,
    completion: int = 4,
    cached: int | None = 50,
    error: str | None = None,
    max_tokens: int = 4,
) -> RequestRecord:
    return RequestRecord(
        "s",
        0,
        "chat",
        max_tokens,
        10,
        ttft_s=ttft,
        e2e_s=e2e,
        itl_s=itl,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        usage_reported=True,
        error=error,
        output_chunks=completion,
    )


def _result(records: list[RequestRecord], duration: float = 2.0, name: str = "t") -> RunResult:
    return RunResult(
        name, "http://x", "m", "agentic", TrafficConfig(concurrency=2), "now", duration, records
    )


def _outcome(name: str, ttft: float, tokps_scale: float = 1.0) -> TargetOutcome:
    records = [_rec(ttft, ttft + 0.3, [0.1, 0.1, 0.1]) for _ in range(4)]
    outcome = TargetOutcome(
        name, f"http://{name}", result=_result(records, 2.0 / tokps_scale, name)
    )
    outcome.metrics = compute_metrics(outcome.result)  # type: ignore[arg-type]
    return outcome


# --- metrics -------------------------------------------------------------------------------


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    values = list(range(1, 11))
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(list(reversed(values)), 0) == 1 and percentile(values, 100) == 10
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_compute_metrics() -> None:
    records = [
        _rec(0.1, 0.4, [0.1, 0.1, 0.1], prompt=100, cached=0),
        _rec(0.2, 0.5, [0.1, 0.1, 0.1], prompt=200, cached=150),
        _rec(0.3, 0.6, [0.1, 0.1, 0.1], prompt=100, cached=None),
        _rec(0.0, 0.1, [], error="HTTP 500: x"),
    ]
    result = _result(records, duration=2.0)
    result.skipped_requests = 3
    m = compute_metrics(result)
    assert (m["requests"], m["completed"], m["errors"], m["skipped"]) == (4, 3, 1, 3)
    assert m["prompt_tokens"] == 400 and m["completion_tokens"] == 12
    assert m["cached_tokens"] == 150 and m["cached_ratio"] == pytest.approx(150 / 400)
    assert m["cached_pct"] == pytest.approx(37.5) and m["cached_missing"] == 1
    assert m["output_tok_s"] == pytest.approx(6.0) and m["total_tok_s"] == pytest.approx(206.0)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["ttft_p50_ms"] == pytest.approx(200) and m["ttft_mean_ms"] == pytest.approx(200)
    assert m["itl_p99_ms"] == pytest.approx(100) and m["e2e_p90_ms"] == pytest.approx(580)
    assert m["tpot_mean_ms"] == pytest.approx(100)
    assert m["error_messages"] == [{"error": "HTTP 500: x", "count": 1}]
    assert m["short_outputs"] == 0
    empty = compute_metrics(_result([], duration=0.0))
    assert (
        empty["cached_ratio"] is None
        and empty["ttft_p50_ms"] is None
        and empty["output_tok_s"] is None
    )


def test_reusable_tokens_is_what_an_unbounded_shared_cache_would_serve() -> None:
    def turn(session: str, index: int, start: float, prompt: int, completion: int = 32) -> RequestRecord:
        return RequestRecord(session, index, "chat", completion, 10, start_s=start, prompt_tokens=prompt,
                             completion_tokens=completion)

    records = [
        turn("a", 0, 0.0, 1100),  # the very first request: nothing cached anywhere
        turn("b", 0, 0.1, 1200),  # a first turn: the 1000-token shared prefix, in whole blocks
        turn("a", 1, 1.0, 1300),  # re-sends turn 0's 1100 + 31 computed reply tokens
        turn("a", 2, 2.0, 1140),  # a shorter prompt: all but its last token, in whole blocks
    ]
    assert reusable_tokens(records, shared_prefix=1000) == 0 + 992 + 1120 + 1136
    failed = turn("b", 1, 1.0, 1500)
    failed.error = "HTTP 500"  # failed turns count for nothing, and say nothing of the next
    assert reusable_tokens([*records, failed, turn("b", 2, 2.0, 1700)], 1000) == 3248 + 992
    m = compute_metrics(_result(records), shared_prefix=1000)
    assert m["reusable_pct"] == pytest.approx(100 * 3248 / 4740)


# --- table, ratios, JSON, PNG --------------------------------------------------------------


def test_table_puts_targets_side_by_side_with_ratios() -> None:
    tandem, vllm = _outcome("tandem", 0.1, tokps_scale=2.0), _outcome("vllm", 0.2)
    table = format_table([tandem, vllm], "title")
    lines = table.splitlines()
    assert lines[0] == "title"
    assert lines[1].split() == ["metric", "tandem", "vllm", "tandem/vllm"]
    ttft = next(x for x in lines if x.startswith("TTFT p50 ms"))
    assert ttft.split()[-4:] == ["100", "200", "0.50x", "better"]
    tokps = next(x for x in lines if x.startswith("output tok/s"))
    assert tokps.split()[-2:] == ["2.00x", "better"]
    errors = next(x for x in lines if x.startswith("errors"))
    assert errors.split() == ["errors", "0", "0"]
    assert "ratio = tandem / target" in table
    rows = ratio_rows([tandem, vllm])
    ttft_row = next(r for r in rows if r["metric"] == "ttft_p50_ms")
    assert ttft_row["ratio"] == pytest.approx(0.5) and ttft_row["higher_is_better"] is False
    assert ratio(1.0, 0.0) is None and ratio(None, 1.0) is None


def test_table_marks_failures_and_missing_cache_counts() -> None:
    ok = _outcome("tandem", 0.1)
    records = [_rec(0.1, 0.2, [0.1], cached=None, completion=3, max_tokens=4)]
    peer = TargetOutcome("peer", "http://p", result=_result(records))
    peer.metrics = compute_metrics(peer.result)  # type: ignore[arg-type]
    dead = TargetOutcome("dead", "http://d", error="server exited with code 1")
    table = format_table([ok, peer, dead])
    cached = next(x for x in table.splitlines() if x.startswith("cached prompt tokens %"))
    assert "0.00*" in cached and "ERROR" in cached
    assert "* peer: no cached_tokens in usage for 1 of 1 requests" in table
    assert "peer: 1 requests returned fewer or more tokens" in table
    assert "dead: server exited with code 1" in table


def test_report_json_schema_and_plot(tmp_path: Path) -> None:
    outcomes = [_outcome("tandem", 0.1), _outcome("vllm", 0.2), TargetOutcome("x", "", error="no")]
    report = build_report(
        outcomes,
        workload={"name": "agentic"},
        args={"concurrency": 2},
        table="t",
        environment={"cpu_count": 2},
    )
    report = json.loads(json.dumps(report))  # JSON-clean
    assert report["schema"] == SCHEMA == "tandem.bench.serve/1"
    assert report["reference"] == "tandem"
    assert [t["name"] for t in report["targets"]] == ["tandem", "vllm", "x"]
    first = report["targets"][0]
    assert first["ok"] and first["metrics"]["completed"] == 4
    assert len(first["run"]["records"]) == 4 and first["run"]["load"]["concurrency"] == 2
    assert set(first["run"]["records"][0]) >= {
        "ttft_s",
        "itl_s",
        "e2e_s",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "error",
        "session_id",
        "turn",
    }
    assert report["targets"][2]["run"] is None and report["targets"][2]["error"] == "no"
    assert {"environment", "args", "workload", "ratios", "table", "created"} <= set(report)
    png = plot(outcomes, tmp_path / "serve.png", "title")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_goal_line() -> None:
    line = goal_line([_outcome("tandem", 0.1, 2.0), _outcome("vllm", 0.2)], "agentic")
    assert line is not None and line.endswith(": met")
    line = goal_line([_outcome("tandem", 0.3), _outcome("vllm", 0.2)], "agentic")
    assert line is not None and "NOT met" in line
    assert goal_line([_outcome("tandem", 0.1)], "agentic") is None
    assert goal_line([_outcome("tandem", 0.1), _outcome("vllm", 0.2)], "fixed") is None


# --- the command's plumbing ----------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_parser_defaults_and_configs() -> None:
    args = _args()
    assert callable(args.handler) and args.workload == "agentic"
    config = traffic_config(args)
    assert config.concurrency == 4 and config.request_rate is None and config.ignore_eos
    wl = workload_config(args, 8192)
    assert (wl.agentic_output_len, wl.output_len, wl.turns_min, wl.turns_max, wl.prefix_len) == (
        32,
        128,
        5,
        20,
        2000,
    )
    args = _args(
        "--request-rate", "2", "--max-concurrency", "3", "--output-len", "7", "--no-ignore-eos"
    )
    config = traffic_config(args)
    assert (config.concurrency, config.request_rate, config.max_concurrency, config.ignore_eos) == (
        None,
        2.0,
        3,
        False,
    )
    assert workload_config(args, 100).agentic_output_len == 7
    with pytest.raises(ValueError):
        traffic_config(_args("--concurrency", "2", "--request-rate", "1"))


def test_targets() -> None:
    assert parse_url_target("vllm=http://127.0.0.1:8000/") == Target(
        "vllm", url="http://127.0.0.1:8000"
    )
    assert parse_url_target("http://h:1") == Target("h:1", url="http://h:1")
    assert parse_url_target("http://h:1/?a=b").name == "h:1"
    with pytest.raises(ValueError):
        parse_url_target("nope")
    targets = plan_targets(["peer=http://h:1"], ["vllm,tandem"])
    assert [t.name for t in targets] == ["tandem", "vllm", "peer"]
    assert targets[0].launch == "tandem" and targets[2].url == "http://h:1"
    for urls, launches in (([], []), ([], ["sglang"]), (["a=http://h:1", "a=http://h:2"], [])):
        with pytest.raises(ValueError):
            plan_targets(urls, launches)


def test_vllm_runs_in_the_dtype_of_tandems_default_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: what `tandem serve` runs without flags on this CPU, so the peer is in its best mode."""
    from tandem.platform.cpu_modes import DEFAULT_MODE_ENV, CpuFeatures

    def dtype(*extra: str) -> str:
        cmd = vllm_command(_args("--launch", "vllm", "--vllm-python", "/v/bin/python", *extra), 99, Path("/hf"),
                           "smollm2-135m", 1 << 30)
        return cmd[cmd.index("--dtype") + 1]

    monkeypatch.delenv(DEFAULT_MODE_ENV, raising=False)
    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls, *a: cls.from_flags(
        ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"])))
    assert dtype() == "bfloat16" and dtype("--vllm-dtype", "float32") == "float32"
    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls, *a: cls.from_flags(["avx2", "fma"])))
    assert dtype() == "float32"


def test_server_commands() -> None:
    args = _args(
        "--launch",
        "tandem",
        "--kv-cache-memory",
        "1GiB",
        "--max-num-seqs",
        "8",
        "--threads",
        "2",
        "--tandem-args",
        "--dtype bfloat16",
        "--vllm-python",
        "/v/bin/python",
        "--max-model-len",
        "4096",
    )
    cmd = tandem_command(args, 1234)
    assert cmd == [
        sys.executable, "-m", "tandem", "serve", "smollm2-135m", "--host", "127.0.0.1",
        "--port", "1234", "--kv-cache-memory", "1GiB", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "2048", "--max-model-len", "4096", "--threads", "2",
        "--no-access-log", "--dtype", "bfloat16",
    ]
    # every flag it passes is one `tandem serve` takes: the command parses
    from tandem.cli.main import build_parser

    serve = build_parser().parse_args(cmd[3:])
    assert (serve.port, serve.kv_cache_memory, serve.dtype, serve.no_access_log) == (1234, "1GiB", "bfloat16", True)
    cmd = vllm_command(args, 99, Path("/hf"), "smollm2-135m", 1 << 30)
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in (
        ("--model", "/hf"),
        ("--served-model-name", "smollm2-135m"),
        ("--port", "99"),
        ("--dtype", "float32"),
        ("--kv-cache-memory-bytes", str(1 << 30)),
        ("--max-num-seqs", "8"),
        ("--max-model-len", "4096"),
    ):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enable-prefix-caching" in cmd and "--enable-prompt-tokens-details" in cmd
    env = vllm_env("/v/bin/python", True, 2)
    assert (
        env["OMP_NUM_THREADS"] == "2"
        and "PYTHONPATH" not in env
        and "VLLM_CPU_KVCACHE_SPACE" not in env
    )


_HEALTH_SERVER = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    print("serving", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_launched_server_ready_and_stopped(tmp_path: Path) -> None:
    port = free_port()
    script = tmp_path / "health.py"
    script.write_text(_HEALTH_SERVER)
    command = [sys.executable, str(script), str(port)]
    server = LaunchedServer("fake", command, {}, tmp_path / "fake.log", port)
    server.start()
    try:
        ready = server.wait_ready(30)
        assert 0 < ready < 30 and server.base_url == f"http://127.0.0.1:{port}"
    finally:
        server.stop(grace_s=5)
    assert server.child is not None and server.child.poll() is not None
    log = (tmp_path / "fake.log").read_text().splitlines()
    assert log[0].startswith("$ ") and log[0].endswith(f"health.py {port}") and log[1] == "serving"
    assert server.describe() == {
        "command": command, "log": str(tmp_path / "fake.log"), "port": port, "ready_s": ready,
        "returncode": -signal.SIGINT,  # stopped by SIGINT, as Ctrl-C would
    }


def test_launched_server_that_dies_reports_its_log(tmp_path: Path) -> None:
    code = "import sys; print('loading weights'); print('fatal: out of memory'); sys.exit(3)"
    server = LaunchedServer(
        "bad", [sys.executable, "-c", code], {}, tmp_path / "bad.log", free_port()
    )
    server.start()
    try:
        with pytest.raises(RuntimeError, match="(?s)bad exited with 3 while starting.*fatal: out of memory"):
            server.wait_ready(30)
    finally:
        server.stop(grace_s=1)
    assert server.describe()["returncode"] == 3 and server.describe()["ready_s"] is None
    slow = LaunchedServer(
        "slow",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        {},
        tmp_path / "slow.log",
        free_port(),
    )
    slow.start()
    try:
        with pytest.raises(RuntimeError, match="not healthy after 2 s: slow"):
            slow.wait_ready(1.5)
    finally:
        slow.stop(grace_s=1)
    assert slow.child is not None and slow.child.poll() is not None


def test_cluster_and_policy_targets() -> None:
    from tandem.bench.serve import _for_target, cluster_command, policy_goal_line

    targets = plan_targets([], ["pd,colocated"], ["round_robin,kv_aware+header"])
    assert [t.name for t in targets] == ["colocated", "pd", "round_robin", "kv_aware+header"]
    policy = targets[3]
    assert policy.launch == "policy" and policy.policy == "kv_aware" and policy.session_header
    with pytest.raises(ValueError):
        plan_targets([], [], ["random"])
    args = _args("--policies", "kv_aware", "--policy-workers", "3", "--kv-cache-memory", "96MiB")
    cmd = cluster_command(args, 4321, "policy", "kv_aware")
    assert cmd[3:5] == ["up", "smollm2-135m"]
    assert cmd[cmd.index("--workers") + 1] == "3" and cmd[cmd.index("--policy") + 1] == "kv_aware"
    assert cmd[cmd.index("--kv-cache-memory") + 1] == "96MiB"
    pd = cluster_command(args, 4321, "pd")
    assert pd[pd.index("--prefill-workers") + 1] == "1" and "--policy" not in pd
    fp8 = cluster_command(_args("--tandem-args", "--kv-cache-dtype fp8"), 4321, "pd")
    assert fp8[-2:] == ["--kv-cache-dtype", "fp8"]  # the engine flags reach every worker
    config = traffic_config(args)
    assert _for_target(config, policy).session_header and not _for_target(config, targets[2]).session_header

    def outcome(name: str, cached_pct: float) -> TargetOutcome:
        return TargetOutcome(name, "", metrics={"cached_pct": cached_pct})

    met = [outcome("round_robin", 55.0), outcome("session", 92.0), outcome("kv_aware", 91.0)]
    assert policy_goal_line(met).endswith(": met")
    missed = [outcome("round_robin", 55.0), outcome("session", 95.0), outcome("kv_aware", 88.0)]
    assert policy_goal_line(missed).endswith("NOT met")
    assert policy_goal_line([outcome("session", 90.0)]) is None


def test_the_kv_tier_goal_line() -> None:
    from tandem.bench.serve import tier_goal_line

    def outcome(name: str, cached_pct: float) -> TargetOutcome:
        return TargetOutcome(name, "", metrics={"cached_pct": cached_pct})

    full = "cpu+disk+cluster"
    assert tier_goal_line([outcome(f"kv_aware/{full}", 95.9), outcome(f"round_robin/{full}", 95.6)]) == (
        f"goal (KV tiers): kv_aware/{full} 95.9% cached (>= 95), round_robin/{full} 95.6% (+0.3 points "
        "behind) (<= 3): met")
    assert tier_goal_line([outcome(f"kv_aware/{full}", 96.0), outcome(f"round_robin/{full}", 92.5)]).endswith(
        "NOT met")
    assert tier_goal_line([outcome(f"kv_aware/{full}", 94.0)]).endswith("NOT met")
    assert tier_goal_line([outcome("kv_aware/cpu", 99.0)]) is None


def test_kv_tier_sets_multiply_policy_targets(tmp_path: Path) -> None:
    from tandem.bench.serve import LaunchContext, build_server, parse_tier_sets

    sets = parse_tier_sets("off,cpu,cpu+disk+cluster")
    assert [s.tiers for s in sets] == [(), ("cpu",), ("cpu", "disk", "cluster")]
    assert {(s.dtype, s.cpu_bytes) for s in sets} == {(None, None)}
    for bad in ("cpu+tape", "cpu@int3", "off@int8", "disk:1GiB", "cpu:lots"):
        with pytest.raises(ValueError):
            parse_tier_sets(bad)
    targets = plan_targets([], [], ["kv_aware,round_robin"], sets)
    assert [t.name for t in targets] == ["kv_aware/off", "round_robin/off", "kv_aware/cpu", "round_robin/cpu",
                                         "kv_aware/cpu+disk+cluster", "round_robin/cpu+disk+cluster"]
    args = _args("--policies", "kv_aware", "--kv-tier-sets", "cpu+disk+cluster", "--kv-store-admit-after", "1",
                 "--kv-store-memory", "6GiB")
    server = build_server(targets[4], args, LaunchContext(), tmp_path)
    cmd = server.command
    assert cmd[cmd.index("--kv-offload-cpu-bytes") + 1] == "2GiB"
    assert cmd[cmd.index("--kv-store-memory") + 1] == "6GiB"
    assert cmd[cmd.index("--kv-store") + 1] == "redis" and cmd[cmd.index("--kv-store-admit-after") + 1] == "1"
    assert cmd[cmd.index("--kv-offload-disk-path") + 1] == str(tmp_path / "kv_aware-cpu-disk-cluster-disk")
    assert server.log_path == tmp_path / "kv_aware-cpu-disk-cluster.log"
    plain = build_server(plan_targets([], [], ["kv_aware"])[0], args, LaunchContext(), tmp_path)
    assert "--kv-store" not in plain.command and "--kv-tier-dtype" not in server.command


def test_a_tier_set_can_keep_its_chunks_in_int8_in_a_cpu_tier_of_its_own_size(tmp_path: Path) -> None:
    """`cpu:240MiB,cpu@int8:120MiB`: one run compares raw chunks with int8 ones in half the memory."""
    from tandem.bench.serve import LaunchContext, build_server, parse_tier_sets

    raw, coded = parse_tier_sets("cpu:240MiB,cpu@int8:120MiB")
    targets = plan_targets([], [], ["kv_aware"], [raw, coded])
    assert [t.name for t in targets] == ["kv_aware/cpu:240MiB", "kv_aware/cpu@int8:120MiB"]
    args = _args("--policies", "kv_aware", "--kv-tier-cpu-bytes", "2GiB")
    commands = [build_server(t, args, LaunchContext(), tmp_path).command for t in targets]
    assert [c[c.index("--kv-offload-cpu-bytes") + 1] for c in commands] == ["240MiB", "120MiB"]
    assert "--kv-tier-dtype" not in commands[0]
    assert commands[1][commands[1].index("--kv-tier-dtype") + 1] == "int8"
    assert commands[1][commands[1].index("--log-dir") + 1] == str(tmp_path / "kv_aware-cpu-int8-120MiB")


def test_the_pd_target_runs_once_per_handoff_codec_and_reports_its_bytes(tmp_path: Path) -> None:
    """--launch pd --kv-transfer-dtypes auto,int8,int4: three pd clusters, each started with its
    codec, and the report line of each says what its decode worker's pulls moved."""
    from tandem.bench.cluster_stats import describe, summarize
    from tandem.bench.serve import LaunchContext, build_server, parse_transfer_dtypes

    dtypes = parse_transfer_dtypes("auto,int8,int4")
    assert dtypes == [None, "int8", "int4"]
    for bad in ("int3", "int8,int8"):
        with pytest.raises(ValueError):
            parse_transfer_dtypes(bad)
    with pytest.raises(ValueError, match="--launch pd"):
        plan_targets([], ["colocated"], [], transfer_dtypes=dtypes)
    targets = plan_targets([], ["colocated,pd"], [], transfer_dtypes=dtypes)
    assert [t.name for t in targets] == ["colocated", "pd", "pd@int8", "pd@int4"]
    args = _args("--launch", "pd")
    commands = [build_server(t, args, LaunchContext(), tmp_path).command for t in targets]
    assert ["--kv-transfer-dtype" in c for c in commands] == [False, False, True, True]
    assert commands[3][commands[3].index("--kv-transfer-dtype") + 1] == "int4"
    assert ["--kv-transfer" in c for c in commands] == [False, True, True, True]  # tcp: shm is raw
    plain = build_server(plan_targets([], ["pd"])[0], args, LaunchContext(), tmp_path).command
    assert "--kv-transfer" not in plain

    decode = {"prefix_cache_queries": 1000, "prefix_cache_hits": 0, "connector_loaded_tokens": 0,
              "kv_transfer": {"pulls": 4, "bytes_received": 640 * 12240, "bytes_per_token_received": 12240.0,
                              "pull_seconds": 0.2}}
    prefill = {"prefix_cache_queries": 1000, "kv_transfer": {"bytes_sent": 640 * 12240, "pulls": 0}}
    line = describe(summarize([{"url": "d", "load": decode}, {"url": "p", "load": prefill}]))
    assert line.endswith("; handoff: 4 pulls of 640 tokens, 12,240 bytes a token (7.5 MiB), 50 ms a pull")
    assert line.startswith("device 0.0% + handoff 0.0%")
    assert "handoff" not in describe(summarize([{"url": "p", "load": prefill}]))
