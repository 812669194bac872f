"""The control plane behind a key, on a real `tandem up` with API keys and an admin key.

What was seen before: with `--api-keys` on, anyone could `POST /workers/ID/drain` on the
router (then every client got 503 `no_healthy_worker`), `/resume` and `/workers/reload`, and
read `/metrics`, `/workers` and `/openapi.json`; on workers, `/reset_prefix_cache`, `/kv/release`
and `/kv/snapshot` were open, since `tandem up` gave them no key. Now the router's control and
views need the admin key, a client's API key is not one, and a worker answers nothing unsigned
but `/health`, except its operator's admin key on its control endpoints.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tandem.router.accounting.keys_store import KeyLimits, new_key, write_store
from tests.support.up_cluster import Up, start_up

ADMIN = "admin-key-for-tests"
SMALL = ("--kv-cache-memory", "128MiB", "--max-num-seqs", "4", "--workers", "2")


@dataclass
class Cluster:
    up: Up
    key: str  # a client's API key


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("control-plane")
    key, stored = new_key("alice", KeyLimits(), set())
    keys = tmp / "keys.json"
    write_store(keys, [stored])
    up = start_up(tmp, *SMALL, "--api-keys", str(keys), "--admin-key", ADMIN)
    yield Cluster(up, key)
    up.process.send_signal(signal.SIGINT)
    up.process.wait(timeout=90)
    assert up.process.returncode == 0, up.stderr.read_text()[-3000:]


def _bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _chat(cluster: Cluster) -> httpx.Response:
    return httpx.post(f"{cluster.up.url}/v1/chat/completions", headers=_bearer(cluster.key), timeout=120,
                      json={"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": 3, "temperature": 0})


def test_router_control_and_views_need_the_admin_key(cluster: Cluster) -> None:
    url = cluster.up.url
    workers = [w for n, w in cluster.up.endpoints().items() if n != "router"]
    worker_id = workers[0].removeprefix("http://")
    control = [("POST", f"/workers/{worker_id}/drain"), ("POST", f"/workers/{worker_id}/resume"),
               ("POST", "/workers/reload")]
    views = [("GET", "/metrics"), ("GET", "/workers"), ("GET", "/openapi.json")]
    for token in (None, "wrong", cluster.key):  # a client's API key is no admin key
        for method, path in control + views:
            reply = httpx.request(method, f"{url}{path}", headers=_bearer(token), timeout=30)
            assert reply.status_code == 401, (token, path, reply.text)
            assert reply.json()["error"]["code"] == "admin_key_required"
    assert _chat(cluster).status_code == 200  # nothing was drained
    for method, path in views:
        assert httpx.request(method, f"{url}{path}", headers=_bearer(ADMIN), timeout=30).status_code == 200
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{url}/dashboard", timeout=30).status_code == 200  # the page itself holds no data
    drained = httpx.post(f"{url}/workers/{worker_id}/drain", headers=_bearer(ADMIN), timeout=30)
    assert drained.status_code == 200 and drained.json()["draining"] is True
    assert _chat(cluster).status_code == 200  # the other worker serves
    resumed = httpx.post(f"{url}/workers/{worker_id}/resume", headers=_bearer(ADMIN), timeout=30)
    assert resumed.json()["draining"] is False


def test_workers_answer_nothing_unsigned_but_health(cluster: Cluster) -> None:
    for name, url in cluster.up.endpoints().items():
        if name == "router":
            continue
        for method, path in (("POST", "/reset_prefix_cache"), ("POST", "/kv/release"), ("GET", "/kv/snapshot"),
                             ("GET", "/kv/events"), ("GET", "/load"), ("GET", "/metrics"),
                             ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/tokenize")):
            for token in (None, cluster.key):
                reply = httpx.request(method, f"{url}{path}", headers=_bearer(token), json={}, timeout=30)
                assert reply.status_code == 401, (name, path, token, reply.text)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        # The operator's admin key opens the worker's control endpoints, not its model.
        assert httpx.post(f"{url}/reset_prefix_cache", headers=_bearer(ADMIN), timeout=30).json() == {"reset": True}
        assert httpx.post(f"{url}/v1/chat/completions", headers=_bearer(ADMIN), json={}, timeout=30).status_code == 401


def test_the_banner_tells_the_operator_which_key_opens_the_control_plane(cluster: Cluster) -> None:
    assert "Control plane (POST" in cluster.up.banner and "the --admin-key" in cluster.up.banner


def test_the_generated_secret_is_written_for_the_operator_only(tmp_path: Path) -> None:
    """Without a secret in the environment, tandem up makes one and leaves it, mode 0600, in its
    log directory: the operator's key to the control plane."""
    from tandem.launch.cluster import write_secret

    path = tmp_path / "cluster-secret"
    write_secret(path, "s3cret")
    assert path.read_text() == "s3cret\n" and path.stat().st_mode & 0o777 == 0o600
