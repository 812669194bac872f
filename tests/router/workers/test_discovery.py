"""Worker discovery from DNS (`tandem route --discover ROLE=HOST:PORT`).

The live test runs a real router whose resolver reads a hosts file of the test's own (the
router runs in a private mount namespace with that file over /etc/hosts: root, as in CI),
and two real workers on 127.0.0.2 and 127.0.0.3 behind one name, as a Kubernetes headless
Service lists its ready pods. Editing the file is a pod becoming ready or going away.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tandem.platform.ports import free_port
from tandem.router.config import DiscoveryTarget, WorkerSpec, parse_discovery_target
from tandem.router.workers.discovery import DnsDiscovery
from tests.support.live_server import LiveServer, start_router, start_server, stop_server

NAME = "tandem-workers.test"


def test_parse_discovery_target() -> None:
    assert parse_discovery_target("prefill=tandem-prefill.ns.svc:8000") == DiscoveryTarget(
        "prefill", "tandem-prefill.ns.svc", 8000)
    assert parse_discovery_target("worker=https://w:443/") == DiscoveryTarget("both", "w", 443, "https")
    assert parse_discovery_target("decode=[fd00::1]:9000").host == "fd00::1"
    for bad in ("tandem:8000", "cook=x:1", "decode=x", "decode=x:0", "decode=x:http", "decode=ftp://x:1"):
        with pytest.raises(ValueError, match="--discover"):
            parse_discovery_target(bad)


def test_discovered_urls_bracket_ipv6() -> None:
    target = DiscoveryTarget("decode", "svc", 8000)
    assert target.url("10.0.0.7") == "http://10.0.0.7:8000"
    assert target.url("fd00::7") == "http://[fd00::7]:8000"


def test_refresh_follows_the_records_and_survives_resolver_failures() -> None:
    answers: list[list[str] | socket.gaierror] = [
        ["10.0.0.2", "10.0.0.1", "10.0.0.1"],  # a pod twice (A records over two families)
        ["10.0.0.1", "10.0.0.2"],  # the same set: no change
        socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),  # keep
        ["10.0.0.2", "10.0.0.3"],  # one pod left, another came
        socket.gaierror(socket.EAI_NONAME, "Name or service not known"),  # no ready pod
    ]

    async def resolver(host: str, port: int) -> list[str]:
        assert (host, port) == ("svc", 8000)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    discovery = DnsDiscovery((DiscoveryTarget("prefill", "svc", 8000),), resolver)

    def urls() -> list[str]:
        return [spec.url for spec in discovery.specs]

    async def run() -> list[tuple[bool, list[str]]]:
        return [(await discovery.refresh(), urls()) for _ in range(5)]

    assert asyncio.run(run()) == [
        (True, ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]),
        (False, ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]),
        (False, ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]),
        (True, ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]),
        (True, []),
    ]
    assert all(spec.role == "prefill" for spec in discovery.specs)


def test_each_target_keeps_its_role() -> None:
    async def resolver(host: str, port: int) -> list[str]:
        return {"p": ["10.0.0.1"], "d": ["10.0.0.2"]}[host]

    discovery = DnsDiscovery((DiscoveryTarget("prefill", "p", 1), DiscoveryTarget("decode", "d", 2)), resolver)
    assert asyncio.run(discovery.refresh())
    assert discovery.specs == (WorkerSpec("http://10.0.0.1:1", "prefill"), WorkerSpec("http://10.0.0.2:2", "decode"))


# --- a real router over real workers, its resolver reading the test's hosts file -----------
needs_mount_namespace = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a private /etc/hosts needs root and util-linux's unshare (CI has both)")


def _write_hosts(path: Path, addresses: list[str]) -> None:
    # In place (same inode): the bind mount shows this file, not whatever replaces it.
    with path.open("r+") as hosts:
        hosts.write("127.0.0.1 localhost\n" + "".join(f"{a} {NAME}\n" for a in addresses))
        hosts.truncate()


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LiveServer]]:
    logs = tmp_path_factory.mktemp("discovery")
    port = free_port()
    started = [start_server(logs / f"pod-{i}.log", "--kv-cache-memory", "128MiB", host=f"127.0.0.{i}", port=port)
               for i in (2, 3)]
    yield started
    for server in started:
        assert not stop_server(server)


def _workers(router: str) -> dict[str, bool]:
    return {w["url"]: w["healthy"] for w in httpx.get(f"{router}/workers", timeout=10).json()["workers"]}


def _wait_for(router: str, expected: dict[str, bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (seen := _workers(router)) != expected:
        assert time.monotonic() < deadline, f"workers {seen}, expected {expected}"
        time.sleep(0.2)


def _chat(router: str) -> httpx.Response:
    return httpx.post(f"{router}/v1/chat/completions", timeout=120, json={
        "model": "smollm2-135m", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi."}]})


@needs_mount_namespace
def test_router_follows_a_headless_service(pods: list[LiveServer], tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("")
    first, second = pods[0].url, pods[1].url
    port = first.rsplit(":", 1)[1]
    _write_hosts(hosts, ["127.0.0.2"])
    script = f'mount --bind "{hosts}" /etc/hosts && exec "$@"'
    log = tmp_path / "route.log"
    url, router = start_router(log, "--discover", f"worker={NAME}:{port}", "--discover-interval", "0.2",
                               wrapper=("unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"))
    try:
        _wait_for(url, {first: True})  # found at start, before any request
        assert _chat(url).status_code == 200

        _write_hosts(hosts, ["127.0.0.2", "127.0.0.3"])  # a second pod became ready
        _wait_for(url, {first: True, second: True})
        _write_hosts(hosts, ["127.0.0.3"])  # the first is draining: out of the Service
        _wait_for(url, {second: True})
        reply = _chat(url)
        assert reply.status_code == 200, reply.text
        _write_hosts(hosts, [])  # no ready pod: the name does not resolve
        _wait_for(url, {})
        reply = _chat(url)
        assert reply.status_code == 503 and reply.json()["error"]["type"], reply.text
        text = log.read_text()
        assert f"discovery: worker={'http://'}{NAME}:{port} resolves to 2 worker(s)" in text, text[-3000:]
    finally:
        router.send_signal(signal.SIGINT)
        router.wait(timeout=30)
