"""The KV-plane attacks, replayed against a real router with API keys over a real prefill and
decode worker (the same cluster secret, as `tandem up` runs them).

What was seen before the trust boundary (tandem/trust): a client's `kv_transfer_params` went
through the router on direct routes (logprobs, short prompts) and the decode worker trusted the
handle it carried: a forged handle naming the prefill worker's shared-memory segment, a
victim's block ids and an attacker-run listener that answered the lease check with OK gave the
victim's KV to the attacker's request; a listener answering FETCH with random blocks and a
matching checksum poisoned the decode worker's prefix cache; the workers contacted any host a
client named, signing to it with the cluster secret; one unauthenticated 400 MiB frame on the
KV port cost the prefill worker 400 MiB. Each attack here must fail closed: the forged field is
stripped or refused (401/403), the attacker's listener is never contacted, the victim's prompt
is no cache hit for the attacker, the poisoned prompt is served with its clean text, and every
process keeps serving with no KV block held afterwards.
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import psutil
import pytest

from tandem.bench.hostile import Listener
from tandem.kvcache.transfer.wire import CHECK, MAGIC
from tandem.router.accounting.keys_store import KeyLimits, new_key, write_store
from tandem.trust.peer import peer_client
from tests.support.live_server import (
    TEST_SECRET,
    LiveServer,
    start_router,
    start_server,
    stop_server,
)

MODEL = "smollm2-135m"
WORKER_ARGS = ("--kv-cache-memory", "128MiB", "--threads", "1")
SECRET_FACT = "The vault code is 4417-ALPHA and the launch is on the ninth."
SYSTEM = "You are the archive assistant. Answer in one short sentence. " * 8


@dataclass
class Cluster:
    router: str
    prefill: LiveServer
    decode: LiveServer
    alice: str  # the victim's API key
    mallory: str  # the attacker's


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("kv-plane-attacks")
    (alice, a), (mallory, m) = (new_key(name, KeyLimits(), set()) for name in ("alice", "mallory"))
    keys = logs / "keys.json"
    write_store(keys, [a, m])
    servers: list[LiveServer] = []
    router = None
    try:
        servers.append(start_server(logs / "prefill.log", "--role", "prefill", "--kv-transfer-shm", *WORKER_ARGS,
                                    secret=TEST_SECRET))
        servers.append(start_server(logs / "decode.log", "--role", "decode", *WORKER_ARGS, secret=TEST_SECRET))
        url, router = start_router(logs / "router.log", "--prefill", servers[0].url, "--decode", servers[1].url,
                                   "--pd-min-prompt-tokens", "32", "--api-keys", str(keys), "--no-ledger",
                                   secret=TEST_SECRET)
        yield Cluster(url, servers[0], servers[1], alice, mallory)
    finally:
        if router is not None:
            router.send_signal(signal.SIGINT)
            router.wait(30)
        for server in servers:
            assert not stop_server(server)


def _chat(cluster: Cluster, key: str, content: str, **extra: object) -> dict:
    body = {"model": MODEL, "temperature": 0, "max_tokens": 12,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}], **extra}
    reply = httpx.post(f"{cluster.router}/v1/chat/completions", json=body, timeout=180,
                       headers={"Authorization": f"Bearer {key}"})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _forged(listener: Listener, prefill: LiveServer) -> dict:
    """The attack's handle: the victim's lease as a guess, the prefill worker's shared memory,
    block ids 0-63, and the attacker's listener as the source to check the lease with."""
    return {"do_remote_prefill": True, "emit_first_token": True, "first_token_ids": [504],
            "transfer_id": "victim-lease", "host": "127.0.0.1", "port": listener.port,
            "block_hashes": list(range(1, 17)), "shm_path": "/dev/shm/tandem-kv-victim", "shm_num_blocks": 64,
            "extra": {"block_ids": list(range(64))},
            "layout": {"num_layers": 30, "num_kv_heads": 3, "block_size": 16, "head_dim": 64, "dtype": "float32"}}


def _settled(*servers: LiveServer) -> None:
    for server in servers:
        deadline = time.monotonic() + 30
        load = server.wait_idle()
        while load["kv_transfer"].get("held") and time.monotonic() < deadline:
            time.sleep(0.2)
            load = server.load()
        assert load["kv_blocks_used"] == 0 and not load["kv_transfer"].get("held"), load
        with server.client() as client:
            assert client.get("/health").status_code == 200


def test_a_forged_handle_reads_nothing_and_poisons_nothing(cluster: Cluster) -> None:
    victim_prompt = f"[{uuid.uuid4().hex}] {SECRET_FACT} Repeat the vault code."
    clean = _chat(cluster, cluster.alice, victim_prompt)  # the victim's turn: its KV is now cached
    clean_text = clean["choices"][0]["message"]["content"]
    listener = Listener()
    try:
        forged = _forged(listener, cluster.prefill)
        # The attacker's own prompt, as long as the victim's, knows no code: had the victim's KV
        # been adopted for it, the code would come out.
        attacker_prompt = victim_prompt.replace("4417-ALPHA", "XXXX-XXXXX")
        reference = _chat(cluster, cluster.mallory, attacker_prompt, logprobs=True)["choices"][0]["message"]
        # Through the router, on a direct route (logprobs) and a split one: the field is stripped.
        for extra in ({"logprobs": True}, {}):
            reply = _chat(cluster, cluster.mallory, attacker_prompt, kv_transfer_params=forged, **extra)
            assert "4417" not in reply["choices"][0]["message"]["content"]
            assert reply["choices"][0]["message"]["content"] == reference["content"]
        # Straight to a worker, unsigned: 401, and the forged source is never asked.
        body = {"model": MODEL, "messages": [{"role": "user", "content": victim_prompt}], "max_tokens": 4,
                "kv_transfer_params": forged}
        for worker in (cluster.decode, cluster.prefill):
            refused = httpx.post(f"{worker.url}/v1/chat/completions", json=body, timeout=60)
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["code"] == "peer_required"
        # Even a peer's signed request cannot point a worker at a file or a block: the handle
        # names a lease and a source, and the source must prove it knows the secret.
        with cluster.decode.client() as client:
            signed = client.post("/v1/chat/completions", json=body)
        assert signed.status_code == 200, signed.text
        assert signed.json()["kv_transfer_params"]["adopted_blocks"] == 0
        assert listener.contacts == 1  # asked once as the peer's source; it could not answer
    finally:
        listener.close()
    # The poisoning attempt left nothing: the victim's next turn is served with the clean text.
    again = _chat(cluster, cluster.alice, victim_prompt)
    assert again["choices"][0]["message"]["content"] == clean_text
    _settled(cluster.prefill, cluster.decode)


def test_a_tenant_salt_cannot_be_computed_or_sent(cluster: Cluster) -> None:
    """Before, the router salted alice's prompts with a hash of her name; mallory sending that
    salt herself (through the router, or to a worker) got 1,136 cached tokens of alice's."""
    import hashlib

    prompt = f"[{uuid.uuid4().hex}] {SECRET_FACT} What day is the launch?"
    _chat(cluster, cluster.alice, prompt)
    assert _chat(cluster, cluster.alice, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] > 32
    old_salt = "tenant-" + hashlib.sha256(b"alice").hexdigest()[:16]
    reply = _chat(cluster, cluster.mallory, prompt, cache_salt=old_salt)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] < 32
    direct = httpx.post(f"{cluster.decode.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt}], "cache_salt": old_salt, "max_tokens": 2})
    assert direct.status_code == 401
    _settled(cluster.prefill, cluster.decode)


def test_a_peer_with_out_of_range_handoff_tokens_gets_400_not_a_dead_engine(cluster: Cluster) -> None:
    """`first_token_ids: [99999999]` killed the decode worker's engine (an embedding index error)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "kv_transfer_params": {"do_remote_prefill": True, "first_token_ids": [99_999_999]}}
    with cluster.decode.client() as client:
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400 and "first_token_ids" in reply.json()["error"]["message"]
        assert client.get("/health").status_code == 200
    assert _chat(cluster, cluster.alice, "Say hi.")["choices"][0]["message"]["content"]
    _settled(cluster.prefill, cluster.decode)


def _tree_rss(pid: int) -> int:
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def test_an_unauthenticated_huge_frame_on_the_kv_port_costs_nothing(cluster: Cluster) -> None:
    source = cluster.prefill.load()["kv_source"]
    host, port = source.removeprefix("tcp://").rsplit(":", 1)
    before = _tree_rss(cluster.prefill.process.pid)
    for head_len, body_len in ((400 << 20, 0), (128, 400 << 20)):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(struct.pack("<4sB3xIQ", MAGIC, CHECK, head_len, body_len) + b"\0" * 32)
            try:
                for _ in range(400):  # 400 MiB more, if the source kept reading
                    sock.sendall(b"\0" * (1 << 20))
            except OSError:
                pass  # the source hung up: what it should do
    assert _tree_rss(cluster.prefill.process.pid) - before < 64 << 20
    # The handoff still works: a long prompt split over the two workers.
    long = _chat(cluster, cluster.alice, f"[{uuid.uuid4().hex}] " + "Tell me about the archive. " * 10)
    assert long["usage"]["prompt_tokens"] > 32
    _settled(cluster.prefill, cluster.decode)


def test_the_handle_a_client_sees_names_no_file_and_no_block(cluster: Cluster) -> None:
    """The prefill reply (which a router forwards, and logs) carries a lease id and its source only."""
    with cluster.prefill.client() as client:
        reply = client.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True},
            "messages": [{"role": "user", "content": "Archive " * 40}]}).json()
    handle = reply["kv_transfer_params"]
    assert set(handle) == {"transfer_id", "host", "port", "block_hashes", "expires_in", "first_token_ids"}
    assert "shm" not in json.dumps(handle)
    with cluster.prefill.client() as client:  # give it back, as the router would
        assert client.post("/kv/release", json={"transfer_id": handle["transfer_id"]}).status_code == 200
    _settled(cluster.prefill, cluster.decode)


def test_unsigned_control_requests_to_workers_are_refused(cluster: Cluster) -> None:
    for worker in (cluster.prefill, cluster.decode):
        for method, path in (("POST", "/reset_prefix_cache"), ("POST", "/kv/release"), ("GET", "/kv/snapshot"),
                             ("GET", "/kv/events"), ("GET", "/load"), ("GET", "/metrics"), ("POST", "/tokenize")):
            reply = httpx.request(method, f"{worker.url}{path}", json={"transfer_id": "x"}, timeout=30)
            assert reply.status_code == 401, (worker.url, path, reply.text)
        assert httpx.get(f"{worker.url}/health", timeout=30).status_code == 200
    with peer_client(TEST_SECRET, timeout=30) as client:  # the router's signature opens them
        assert client.get(f"{cluster.decode.url}/kv/snapshot").status_code == 200


def test_a_worker_without_a_secret_refuses_the_handoff_fields(tandem_server: str) -> None:
    """A standalone worker (no cluster secret) has no peers: the field is refused, never trusted."""
    listener = Listener()
    try:
        for params in ({"do_remote_decode": True}, {"do_remote_prefill": True, "first_token_ids": [1],
                                                    "transfer_id": "x", "host": "127.0.0.1", "port": listener.port,
                                                    "block_hashes": [1]}):
            reply = httpx.post(f"{tandem_server}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                "kv_transfer_params": params})
            assert reply.status_code == 403, reply.text
            assert reply.json()["error"]["code"] == "internal_field"
        assert listener.contacts == 0
    finally:
        listener.close()
    load = httpx.get(f"{tandem_server}/load", timeout=30).json()
    assert load["kv_transfer"].get("held", 0) == 0
