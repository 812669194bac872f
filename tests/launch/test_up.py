"""`tandem up`: the plan it makes (no processes), then real clusters started and stopped."""

from __future__ import annotations

import ipaddress
import itertools
import json
import signal
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from tandem.cli.main import build_parser
from tandem.launch.cluster_plan import banner, default_threads, engine_argv, plan_cluster
from tandem.launch.netns import WorkerNetwork
from tests.support.netns_hosts import needs_netns
from tests.support.processes import wait_ended
from tests.support.up_cluster import Up, start_up

SMALL = ["--kv-cache-memory", "256MiB", "--threads", "1", "--max-num-seqs", "8"]


def _args(*argv: str):  # noqa: ANN202 - argparse.Namespace
    return build_parser().parse_args(["up", *argv])


def _ports():  # noqa: ANN202
    counter = itertools.count(9100)
    return lambda: next(counter)


def test_plan_prefill_and_decode_workers(tmp_path: Path) -> None:
    args = _args(
        "--prefill-workers",
        "2",
        "--kv-cache-memory",
        "256MiB",
        "--decode-max-num-seqs",
        "8",
        "--prefill-max-num-batched-tokens",
        "4096",
        "--log-dir",
        str(tmp_path),
        "--port",
        "8123",
    )
    plan = plan_cluster(args, Path("/models/smol"), free_port=_ports())
    assert [w.name for w in plan.workers] == ["prefill-0", "prefill-1", "decode-0"]
    prefill, _, decode = (list(w.argv) for w in plan.workers)
    assert (
        prefill[prefill.index("--role") + 1] == "prefill"
        and decode[decode.index("--role") + 1] == "decode"
    )
    assert prefill[prefill.index("--kv-cache-memory") + 1] == "256MiB"
    assert "--max-num-seqs" not in prefill and decode[decode.index("--max-num-seqs") + 1] == "8"
    # One cluster secret for the KV ports, in every worker's environment, on no command line.
    secrets = {w.env["TANDEM_CLUSTER_SECRET"] for w in plan.workers}
    assert len(secrets) == 1 and len(next(iter(secrets))) == 64
    assert not any(next(iter(secrets)) in " ".join(w.argv) for w in (*plan.workers, plan.router))
    assert decode[decode.index("--max-request-bytes") + 1] == str(16 << 20)  # workers and router
    assert list(plan.router.argv).count("--max-messages") == 1
    assert prefill[prefill.index("--max-num-batched-tokens") + 1] == "4096"
    assert (
        prefill[prefill.index("--port") + 1] == "9100"
        and plan.workers[0].url == "http://127.0.0.1:9100"
    )
    router = list(plan.router.argv)
    assert router[router.index("route") : router.index("route") + 5] == [
        "route",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
    ]
    assert router.count("--prefill") == 2 and router.count("--decode") == 1
    assert router[router.index("--tokenizer") + 1] == "/models/smol"
    assert plan.router.log_path == tmp_path / "router.log"
    text = banner(plan)
    assert (
        "http://127.0.0.1:8123/v1" in text
        and "curl http://127.0.0.1:8123/v1/chat/completions" in text
    )
    assert "OpenAI(base_url=" in text


def test_plan_colocated_workers_and_thread_split(tmp_path: Path) -> None:
    plan = plan_cluster(
        _args("--workers", "2", "--log-dir", str(tmp_path)), None, free_port=_ports()
    )
    assert [w.name for w in plan.workers] == ["worker-0", "worker-1"]
    assert all(w.argv[w.argv.index("--role") + 1] == "both" for w in plan.workers)
    assert list(plan.router.argv).count("--worker") == 2 and "--tokenizer" not in plan.router.argv
    threads = str(default_threads(2))  # the cores split between the two workers
    assert all(w.argv[w.argv.index("--threads") + 1] == threads for w in plan.workers)


def test_plan_passes_pricing_ledger_and_keys_to_the_router(tmp_path: Path) -> None:
    default = list(plan_cluster(_args(), None, free_port=_ports()).router.argv)
    assert default[default.index("--ledger") + 1] == "tandem-usage.sqlite3"
    assert "--api-keys" not in default and "--prices" not in default
    args = _args(
        "--prices",
        "p.json",
        "--api-keys",
        "keys.txt",
        "--no-ledger",
        "--usage-admin",
        "ops",
        "--log-dir",
        str(tmp_path),
    )
    plan = plan_cluster(args, None, free_port=_ports())
    router = list(plan.router.argv)
    assert router[router.index("--prices") + 1] == "p.json"
    assert router[router.index("--api-keys") + 1] == "keys.txt"
    assert router[router.index("--usage-admin") + 1] == "ops"
    assert "--no-ledger" in router and "--ledger" not in router
    assert all("--api-keys" not in w.argv for w in plan.workers)  # workers get no router flags
    text = banner(plan)
    assert "-H 'Authorization: Bearer $KEY'" in text and 'api_key="<KEY>"' in text


def test_plan_hands_the_secret_and_the_admin_key_to_every_process_in_its_environment(tmp_path: Path,
                                                                                   monkeypatch) -> None:  # noqa: ANN001
    """The router signs every hop and its workers answer nothing else: all share one secret,
    which, like the admin key, appears on no command line."""
    monkeypatch.delenv("TANDEM_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("TANDEM_ADMIN_KEY", raising=False)
    plan = plan_cluster(_args("--admin-key", "op-key", "--public-metrics", "--log-dir", str(tmp_path)), None,
                        free_port=_ports(), secret="the-secret")
    for process in (plan.router, *plan.workers):
        assert process.env is not None and process.env["TANDEM_CLUSTER_SECRET"] == "the-secret", process.name
        assert process.env["TANDEM_ADMIN_KEY"] == "op-key"
        assert not any("the-secret" in a or "op-key" in a for a in process.argv)
        assert "--public-metrics" in process.argv
    assert "the --admin-key" in banner(plan)
    plain = plan_cluster(_args("--log-dir", str(tmp_path)), None, free_port=_ports(), secret="s")
    assert "TANDEM_ADMIN_KEY" not in (plain.router.env or {}) and "--public-metrics" not in plain.router.argv
    assert f"the cluster secret in {tmp_path / 'cluster-secret'}" in banner(plain)


def test_plan_passes_tier_credits_to_the_router_and_checks_them_first() -> None:
    default = list(plan_cluster(_args(), None, free_port=_ports()).router.argv)
    assert not any(flag.startswith("--kv-credit-") for flag in default)  # measured per worker
    router = list(plan_cluster(_args("--kv-credit-disk", "0.5"), None, free_port=_ports()).router.argv)
    assert router[router.index("--kv-credit-disk") + 1] == "0.5"
    assert "--kv-credit-cpu" not in router
    with pytest.raises(ValueError, match="--kv-credit-cluster must be between 0 and 1"):
        plan_cluster(_args("--kv-credit-cluster", "2"), None, free_port=_ports())


def test_engine_argv_repeats_only_what_was_set() -> None:
    assert engine_argv(_args()) == []
    argv = engine_argv(
        _args(
            "--dtype",
            "bfloat16",
            "--no-prefix-caching",
            "--max-model-len",
            "2048",
            "--threads",
            "3",
        )
    )
    assert argv == ["--dtype", "bfloat16", "--max-model-len", "2048", "--no-prefix-caching"]


def test_bad_counts_are_refused() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tandem", "up", "--workers", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "--workers must be >= 1" in result.stderr


# --- real clusters -------------------------------------------------------------------------
def _start_up(tmp_path: Path, *argv: str) -> Up:
    """`tandem up` on the small settings every cluster here shares."""
    return start_up(tmp_path, *SMALL, *argv)


def _tree(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _chat(url: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
    reply = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=180,
        json={"model": "smollm2-135m", "messages": messages, "max_tokens": max_tokens,
              "temperature": 0},
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def _transfers(up: Up, worker_url: str) -> dict:
    return up.load(worker_url)["kv_transfer"]


# Well above --pd-min-prompt-tokens (256): the router splits it into a prefill and a decode hop.
LONG_SYSTEM = (
    "You are a helpful assistant for a travel agency. You answer questions about cities, "
    "their history, food and weather briefly and precisely. "
) * 12


def test_up_serves_and_ctrl_c_leaves_no_process(tmp_path: Path) -> None:
    up = _start_up(tmp_path)
    process, url = up.process, up.url
    try:
        children = _tree(process.pid)
        # router + 2 workers, each worker with its engine core process
        assert len(children) >= 5, [c.cmdline() for c in children]
        endpoints = up.endpoints()
        assert sorted(endpoints) == ["decode-0", "prefill-0", "router"] and endpoints["router"] == url
        workers = httpx.get(f"{url}/workers", timeout=10).json()["workers"]
        assert sorted(w["role"] for w in workers) == ["decode", "prefill"] and all(
            w["healthy"] for w in workers
        )
        assert {w["load"]["role"] for w in workers} == {"prefill", "decode"}  # started with --role
        # The prefill worker's KV port serves only the cluster's own workers (signed frames), and
        # the worker itself only its router: unsigned, its API answers 401.
        from tandem.kvcache.transfer.wire import CHECK, ERR, FrameKey, send_frame

        source = next(w["load"]["kv_source"] for w in workers if w["role"] == "prefill")
        host, port = source.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            send_frame(sock, FrameKey("a guess"), CHECK, {"transfer_id": "x", "ts": time.time(), "nonce": "n" * 32})
            reply = sock.recv(64)
        assert reply[4] == ERR  # refused (and signed with the real key, which the guesser cannot check)
        for name in ("prefill-0", "decode-0"):
            assert httpx.get(f"{endpoints[name]}/v1/models", timeout=10).status_code == 401
            assert httpx.get(f"{endpoints[name]}/health", timeout=10).status_code == 200

        # A short prompt goes whole to the decode worker: greedy, the README's answer.
        short = _chat(url, [{"role": "user", "content": "What is the capital of France?"}], 20)
        assert short["choices"][0]["message"]["content"] == "The capital of France is Paris."
        assert short["choices"][0]["finish_reason"] == "stop"

        # A long one is prefilled on prefill-0, and decode-0 pulls its KV blocks.
        messages = [
            {"role": "system", "content": f"Ticket {uuid.uuid4().hex[:12]}. {LONG_SYSTEM}"},
            {"role": "user", "content": "What should I eat in Lisbon?"},
        ]
        before = _transfers(up, endpoints["decode-0"])
        block = up.load(endpoints["decode-0"])["block_size"]
        assert block == 64  # the workers' own default on a CPU
        first = _chat(url, messages, 8)
        after = _transfers(up, endpoints["decode-0"])
        usage = first["usage"]
        assert usage["prompt_tokens"] > 256 and usage["completion_tokens"] == 8
        assert after["pulls"] == before["pulls"] + 1
        assert after["pull_failures"] == before["pull_failures"]
        # every whole block of the prompt moved (none was cached on the decode worker yet)
        assert after["blocks_received"] - before["blocks_received"] == usage["prompt_tokens"] // block
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # a new prompt

        # Again: split again, and the prefill worker finds the prompt in its prefix cache:
        # every whole block short of the last token (always computed).
        again = _chat(url, messages, 8)
        assert _transfers(up, endpoints["decode-0"])["pulls"] == after["pulls"] + 1
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (again["usage"]["prompt_tokens"] - 1) // block * block > 0
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=90)
    assert process.returncode == 0, up.stderr.read_text()[-3000:]
    out = up.stdout.read_text()
    assert out.startswith("tandem up: 1 prefill + 1 decode worker(s) serving smollm2-135m; "
                          f"OpenAI endpoint {url}/v1\n")
    assert out.rstrip().endswith("Ctrl-C stops the cluster.")
    alive = wait_ended(children, timeout=10)
    assert not alive, [p.pid for p in alive]
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["decode-0.log", "prefill-0.log", "router.log"]
    assert "stopping the cluster" in up.stderr.read_text()


def test_a_dying_worker_stops_the_cluster(tmp_path: Path) -> None:
    up = _start_up(tmp_path, "--workers", "1", "--max-restarts", "0")
    process = up.process
    children = _tree(process.pid)
    worker = next(c for c in psutil.Process(process.pid).children() if "serve" in c.cmdline())
    worker.kill()
    try:
        code = process.wait(90)
    finally:
        if process.poll() is None:
            process.kill()
    assert code == 1
    assert "worker-0 exited with -9, its 1st crash in 300 s; giving up" in up.stderr.read_text()
    alive = wait_ended(children, timeout=10)
    assert not alive, [p.pid for p in alive]


def test_every_http_and_kv_port_is_distinct_even_if_the_picker_repeats(tmp_path: Path) -> None:
    """A KV source binding a random port once took a worker's HTTP port: up picks them all."""
    repeats = iter([9100, 9100, 9101, 9101, 8123, 9102, 9103, 9104, 9105])
    args = _args("--prefill-workers", "2", "--log-dir", str(tmp_path), "--port", "8123")
    plan = plan_cluster(args, None, free_port=lambda: next(repeats))
    ports = []
    for worker in plan.workers:
        argv = list(worker.argv)
        ports.append(int(argv[argv.index("--port") + 1]))
        if "--kv-transfer-port" in argv:
            ports.append(int(argv[argv.index("--kv-transfer-port") + 1]))
            assert "--kv-transfer-shm" in argv  # same host: the decode worker copies from /dev/shm
        else:
            assert argv[argv.index("--role") + 1] == "decode"
    assert len(ports) == len(set(ports)) == 5 and 8123 not in ports


def test_each_worker_gets_its_own_disk_tier_directory(tmp_path: Path) -> None:
    args = _args("--workers", "2", "--kv-offload-disk-path", str(tmp_path / "kv"),
                 "--kv-offload-cpu-bytes", "1GiB", "--log-dir", str(tmp_path / "logs"))
    plan = plan_cluster(args, None, free_port=_ports())
    for worker in plan.workers:
        argv = list(worker.argv)
        assert argv.count("--kv-offload-disk-path") == 1
        assert argv[argv.index("--kv-offload-disk-path") + 1] == str(tmp_path / "kv" / worker.name)
        assert argv[argv.index("--kv-offload-cpu-bytes") + 1] == "1GiB"


def test_kv_store_redis_starts_a_local_server_for_the_workers(tmp_path: Path) -> None:
    import redis

    from tandem.kvcache.tiers.open import open_cluster_store
    from tandem.launch.cluster import start_local_store

    args = _args("--kv-store", "redis", "--kv-store-memory", "64MiB")
    secret = "cluster secret " + uuid.uuid4().hex
    server = start_local_store(args, tmp_path, secret)
    try:
        assert args.kv_store == server.url and args.kv_store.startswith("redis://127.0.0.1:")
        # Only peers with the cluster secret get in; it is on no command line.
        assert secret not in " ".join(psutil.Process(server.pid).cmdline())
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url, password="a guess").ping()
        client = redis.Redis.from_url(server.url, password=secret)
        assert client.config_get("maxmemory")["maxmemory"] == str(64 << 20)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
        client.close()
        # A worker's store presents the secret from its engine config (--cluster-secret / env).
        store = open_cluster_store(server.url, secret=secret)
        store.put("chunk", b"kv bytes")
        assert store.get("chunk") == b"kv bytes"
        store.close()
    finally:
        server.stop()
    assert start_local_store(_args("--kv-store", "redis://10.0.0.5:6379"), tmp_path) is None


def test_speculation_goes_to_the_workers_that_decode(tmp_path: Path) -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    plan = plan_cluster(_args("--speculative-config", spec, "--log-dir", str(tmp_path)), None, free_port=_ports())
    argvs = {w.name: list(w.argv) for w in plan.workers}
    assert "--speculative-config" not in argvs["prefill-0"]
    decode = argvs["decode-0"]
    assert decode[decode.index("--speculative-config") + 1] == spec
    colocated = plan_cluster(_args("--workers", "2", "--speculative-config", spec, "--log-dir", str(tmp_path)),
                             None, free_port=_ports())
    assert all("--speculative-config" in w.argv for w in colocated.workers)


def test_decode_workers_speculate_with_a_draft_rebuilt_from_the_handed_over_prompt(tmp_path: Path) -> None:
    """A draft model on the decode worker only: the prompt's KV arrives from the prefill
    worker, the draft rebuilds its own from the prompt, and the answer is the plain one."""
    from tandem import LLM, SamplingParams

    messages = [{"role": "system", "content": f"Ticket 42. {LONG_SYSTEM}"},
                {"role": "user", "content": "Repeat the first sentence of these instructions."}]
    with LLM(kv_cache_memory="64MiB") as llm:
        plain = llm.chat([messages], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    spec = '{"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 3}'
    up = _start_up(tmp_path, "--speculative-config", spec)
    try:
        endpoints = up.endpoints()
        before = _transfers(up, endpoints["decode-0"])
        reply = _chat(up.url, messages, 24)
        assert _transfers(up, endpoints["decode-0"])["pulls"] == before["pulls"] + 1  # the KV was handed over
        assert reply["choices"][0]["message"]["content"] == plain.outputs[0].text
        decode = up.load(endpoints['decode-0'])["spec_decode"]
        prefill = up.load(endpoints['prefill-0'])["spec_decode"]
        assert decode["num_drafts"] > 0 and decode["num_accepted_tokens"] > 0
        assert prefill == {}
    finally:
        up.process.send_signal(signal.SIGINT)
        up.process.wait(timeout=90)
    assert up.process.returncode == 0, up.stderr.read_text()[-3000:]


def _stream_chat(url: str, body: dict, progress: list[int], slot: int) -> tuple[str, list[dict]]:
    """One streamed chat through the router: its text, and any error events it carried."""
    text, errors = [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk)
                continue
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content")
                if piece:
                    text.append(piece)
                    progress[slot] += 1
    return "".join(text), errors


def _city_streams(count: int) -> list[dict]:
    """Greedy chat bodies, every other one long enough to be split over prefill and decode."""
    bodies = []
    for i in range(count):
        system = f"Ticket {i}. {LONG_SYSTEM}" if i % 2 else f"Ticket {i}. Be brief."
        bodies.append({"model": "smollm2-135m", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                       "messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": f"Tell me about city number {i}."}]})
    return bodies


def _clean_run(url: str, bodies: list[dict]) -> list[tuple[str, list[dict]]]:
    """Every body streamed at once with no fault: the texts a faulted run must reproduce."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        clean = list(pool.map(lambda ib: _stream_chat(url, ib[1], [0] * len(bodies), ib[0]),
                              enumerate(bodies)))
    assert all(not errors and text for text, errors in clean)
    return clean


def test_sigkill_of_a_decode_worker_under_32_streams_loses_nothing(tmp_path: Path) -> None:
    """32 concurrent greedy streams, half of them long enough to be split over prefill and
    decode; a decode worker is SIGKILLed mid-stream. The router moves its streams to the other
    decode worker with the tokens sent so far: every stream completes with the text of a clean
    run. `tandem up` restarts the dead worker, which rejoins; nothing is left held."""
    up = _start_up(tmp_path, "--decode-workers", "2", "--max-num-seqs", "16",
                   "--kv-cache-memory", "512MiB")
    process, url = up.process, up.url
    try:
        bodies = _city_streams(32)
        clean = _clean_run(url, bodies)

        endpoints = up.endpoints()
        victim = next(c for c in psutil.Process(process.pid).children()
                      if endpoints["decode-0"].rsplit(":", 1)[1] in " ".join(c.cmdline()))
        progress = [0] * 32
        with ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(_stream_chat, url, b, progress, i) for i, b in enumerate(bodies)]
            deadline = time.monotonic() + 120
            while sum(p >= 4 for p in progress) < 16 and time.monotonic() < deadline:
                time.sleep(0.05)
            for proc in [*victim.children(recursive=True), victim]:
                proc.kill()
            faulted = [f.result() for f in futures]
        assert [errors for _, errors in faulted] == [[]] * 32
        assert [text for text, _ in faulted] == [text for text, _ in clean]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        moved = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("tandem_router_migrations_total{"))
        assert moved >= 1
        print(f"migrated streams: {moved:.0f}")

        # The dead worker is restarted on its port and the router takes it back.
        def all_healthy() -> bool:
            workers = httpx.get(f"{url}/workers", timeout=10).json()["workers"]
            return len(workers) == 3 and all(w["healthy"] for w in workers)

        deadline = time.monotonic() + 180
        while not all_healthy() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert all_healthy(), up.stderr.read_text()[-3000:]
        log = up.stderr.read_text()
        assert "decode-0 exited unexpectedly with -9; restarting it in 1 s" in log
        assert "decode-0 is healthy again" in log
        # Nothing held or running anywhere: the prefill worker's leases for the dead worker's
        # pulls were released by the router, not left to expire.
        for name in ("prefill-0", "decode-1"):
            load = up.load(endpoints[name])
            assert load["num_running_requests"] == load["num_waiting_requests"] == 0, name
            if name == "prefill-0":
                assert load["kv_transfer"]["held"] == 0
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=90)
    assert process.returncode == 0, up.stderr.read_text()[-3000:]


@needs_netns
def test_a_cut_link_to_a_decode_worker_under_16_streams_loses_nothing(tmp_path: Path) -> None:
    """`tandem up --netns` puts each worker in a network namespace of its own; the link of a
    decode worker is cut mid-stream, so its streams fall silent instead of breaking. The
    router's health checks mark it down, its streams move to the other decode worker, and
    every stream completes with a clean run's text. Mended, the worker rejoins and ends the
    requests the router gave up, holding nothing; Ctrl-C removes the namespaces."""
    up = _start_up(tmp_path, "--netns", "--decode-workers", "2", "--max-num-seqs", "16",
                   "--kv-cache-memory", "512MiB")
    process, url = up.process, up.url
    network = WorkerNetwork(int(url.rsplit(":", 1)[1]))
    endpoints = up.endpoints()
    try:
        assert all(ipaddress.ip_address(httpx.URL(endpoints[w]).host) in network.subnet
                   for w in ("prefill-0", "decode-0", "decode-1")), endpoints
        bodies = _city_streams(16)
        clean = _clean_run(url, bodies)
        # The PD handoff crossed the bridge: decode workers pulled prompt KV from prefill-0.
        assert _transfers(up, endpoints["decode-0"])["pulls"] + _transfers(up, endpoints["decode-1"])["pulls"] >= 1

        progress = [0] * 16
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(_stream_chat, url, b, progress, i) for i, b in enumerate(bodies)]
            deadline = time.monotonic() + 120
            while sum(p >= 4 for p in progress) < 8 and time.monotonic() < deadline:
                time.sleep(0.05)
            network.cut("decode-0")
            cut_at = time.monotonic()
            faulted = [f.result() for f in futures]
        waited = time.monotonic() - cut_at
        assert [errors for _, errors in faulted] == [[]] * 16
        assert [text for text, _ in faulted] == [text for text, _ in clean]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        moved = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("tandem_router_migrations_total{"))
        assert moved >= 1
        print(f"migrated streams: {moved:.0f}; streams done {waited:.1f} s after the cut")
        assert "(decode) is down after 3 failures" in (tmp_path / "logs" / "router.log").read_text()

        network.mend("decode-0")

        def settled() -> bool:
            workers = httpx.get(f"{url}/workers", timeout=10).json()["workers"]
            if not (len(workers) == 3 and all(w["healthy"] for w in workers)):
                return False
            loads = {n: up.load(endpoints[n])
                     for n in ("prefill-0", "decode-0", "decode-1")}
            return all(load["num_running_requests"] == load["num_waiting_requests"] == 0
                       and load["kv_blocks_used"] == 0 and not load["kv_transfer"].get("held")
                       for load in loads.values())

        deadline = time.monotonic() + 120
        while not settled() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert settled(), up.stderr.read_text()[-3000:]
        assert "exited unexpectedly" not in up.stderr.read_text()  # nothing died: only a link
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=90)
    assert process.returncode == 0, up.stderr.read_text()[-3000:]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert network.namespace("decode-0") not in namespaces


def test_each_worker_gets_its_own_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--device cuda: worker i sees only the i-th visible GPU; too few GPUs is a clear error."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5,7")
    args = _args("--device", "cuda", "--log-dir", str(tmp_path))
    plan = plan_cluster(args, None, free_port=_ports())
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in plan.workers] == ["2", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError, match="2 workers need a GPU each, this host shows 1"):
        plan_cluster(args, None, free_port=_ports())
    cpu = plan_cluster(_args("--log-dir", str(tmp_path)), None, free_port=_ports())
    assert all("CUDA_VISIBLE_DEVICES" not in w.env or w.env["CUDA_VISIBLE_DEVICES"] == "3" for w in cpu.workers)


def test_the_transfer_dtype_goes_to_the_workers_that_fetch() -> None:
    """`tandem up --kv-transfer tcp --kv-transfer-dtype int4`: the decode workers ask for 4-bit
    blocks (a prefill worker serves whatever it is asked for); by default nobody is told."""
    plan = plan_cluster(_args("--kv-transfer", "tcp", "--kv-transfer-dtype", "int4"), None, free_port=_ports())
    prefill, decode = (list(w.argv) for w in plan.workers)
    assert decode[decode.index("--kv-transfer-dtype") + 1] == "int4" and "--kv-transfer-dtype" not in prefill
    assert not any("--kv-transfer-dtype" in w.argv for w in plan_cluster(_args(), None, free_port=_ports()).workers)
    from tandem.flags.engine import kv_transfer_config

    worker = build_parser().parse_args(["serve", "m", "--role", "decode", "--cluster-secret", "s"])
    assert kv_transfer_config(worker).transfer_codec == "raw"
    worker = build_parser().parse_args(["serve", "m", "--role", "decode", "--cluster-secret", "s",
                                        "--kv-transfer-dtype", "int4"])
    assert kv_transfer_config(worker).transfer_codec == "int4"


def test_the_generation_defaults_go_to_every_worker() -> None:
    """`tandem up --override-generation-config JSON` hands the same defaults to each worker (the
    decode worker samples; a colocated one does both); bad JSON fails before anything starts."""
    defaults = '{"temperature": 0.7, "max_new_tokens": 512}'
    plan = plan_cluster(_args("--override-generation-config", defaults), None, free_port=_ports())
    assert [w.argv[list(w.argv).index("--override-generation-config") + 1] for w in plan.workers] == [defaults] * 2
    assert not any("--override-generation-config" in w.argv for w in plan_cluster(_args(), None, free_port=_ports()).workers)
    from tandem.launch.up_flags import check_up

    with pytest.raises(ValueError, match="'seed' is not one of"):
        check_up(_args("--override-generation-config", '{"seed": 1}'))
    result = subprocess.run([sys.executable, "-m", "tandem", "up", "--override-generation-config", "{bad"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "is not JSON" in result.stderr
