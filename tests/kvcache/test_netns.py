"""KV across hosts: prefill workers, a decode worker and Redis each on a host of their own.

Each "host" is a Linux network namespace on a bridge (10.77.x.0/24), reached from the test's
namespace like another machine: nothing binds 127.0.0.1, the prefill/decode handoff goes over
tcp (shared memory cannot cross hosts), and the cluster store is a redis-server on its own
host. Checked: a request through the router is prefilled on one host and decoded on another
(the decode worker computes none of the prompt), and a second prefill worker that never saw
the session serves its next turn from the cluster store. Needs root (CI runs as root).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.support.live_server import (
    TEST_SECRET,
    LiveServer,
    start_router,
    start_server,
    stop_server,
)
from tests.support.netns_hosts import Hosts, make_hosts, needs_netns

pytestmark = needs_netns


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with make_hosts(["prefill0", "prefill1", "decode", "redis"], "tdm") as made:
        yield made


@dataclass
class Cluster:
    prefill: list[LiveServer]
    decode: LiveServer
    router_url: str
    redis_url: str


@pytest.fixture(scope="module")
def cluster(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("netns")
    redis_host = hosts.addresses["redis"]
    redis_url = f"redis://{redis_host}:6379"
    redis_process = subprocess.Popen([*hosts.exec("redis"), "redis-server", "--port", "6379", "--bind", redis_host,
                                      "--save", "", "--appendonly", "no", "--protected-mode", "no",
                                      "--maxmemory", str(512 << 20), "--maxmemory-policy", "allkeys-lru",
                                      # as `tandem up` runs it: the workers present the cluster secret
                                      "--requirepass", TEST_SECRET],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    servers: list[LiveServer] = []
    router = None
    try:
        engine = ("--kv-cache-memory", "128MiB", "--threads", "1", "--kv-store", redis_url,
                  "--kv-store-admit-after", "1")
        for name in ("prefill0", "prefill1"):
            address = hosts.addresses[name]
            servers.append(start_server(logs / f"{name}.log", *engine, "--role", "prefill",
                                        "--kv-transfer-host", address, host=address, wrapper=hosts.exec(name),
                                        secret=TEST_SECRET))
        decode_address = hosts.addresses["decode"]
        decode = start_server(logs / "decode.log", "--kv-cache-memory", "128MiB", "--threads", "1",
                              "--role", "decode", host=decode_address, wrapper=hosts.exec("decode"),
                              secret=TEST_SECRET)
        servers.append(decode)
        router_url, router = start_router(logs / "router.log", "--policy", "round_robin", "--pd-min-prompt-tokens",
                                          "16", "--prefill", servers[0].url, "--prefill", servers[1].url,
                                          "--decode", decode.url, secret=TEST_SECRET)
        yield Cluster(servers[:2], decode, router_url, redis_url)
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        for server in servers:
            stop_server(server)
        redis_process.terminate()
        redis_process.wait(10)


SYSTEM = "You are the harbour master's assistant. Answer briefly and precisely. " * 30


def chat(url: str, question: str) -> dict:
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2-135m", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_handoff_and_cluster_tier_across_hosts(cluster: Cluster) -> None:
    # Nothing here listens on loopback: every address is on the bridge.
    assert all("127.0.0.1" not in s.url for s in (*cluster.prefill, cluster.decode))
    first = chat(cluster.router_url, "Which ship came in first today?")
    decode_load = cluster.decode.load()
    assert decode_load["kv_transfer"]["blocks_received"] > 0  # over tcp, between hosts
    # Round robin sends the next turn to the other prefill worker, which never saw this prompt:
    # it reads the prefix from Redis on the redis host.
    second = chat(cluster.router_url, "Which ship came in second today?")
    loads = [p.load() for p in cluster.prefill]
    cluster_hits = [load["kv_tiers"]["media"]["cluster"].get("chunk_hits", 0) for load in loads]
    assert sorted(cluster_hits)[-1] >= 1 and sorted(cluster_hits)[0] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert first["choices"][0]["message"]["content"]
    for server in (*cluster.prefill, cluster.decode):
        assert server.wait_idle()["kv_blocks_used"] == 0
