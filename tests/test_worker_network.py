"""`tandem up --netns`'s network (tandem/launch/netns.py): names, addresses, and a real namespace
whose link is cut and mended (needs root and iproute2, which CI has)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx

from tandem.launch.netns import WorkerNetwork
from tests.support.netns_hosts import needs_netns


def test_names_and_addresses_follow_the_router_port() -> None:
    network = WorkerNetwork(8461)
    assert str(network.subnet) == "10.33.13.0/24" and network.gateway == "10.33.13.1"
    assert network.address("prefill-0") == "10.33.13.2"
    assert network.address("decode-0") == "10.33.13.3"
    assert network.address("prefill-0") == "10.33.13.2"  # stable
    assert network.namespace("decode-0") == "tandem-8461-decode-0"
    assert network.exec_prefix("decode-0") == ["ip", "netns", "exec", "tandem-8461-decode-0"]
    assert len(network.bridge) <= 15 and len(WorkerNetwork(65535).bridge) <= 15  # IFNAMSIZ


def _wait_answering(url: str, seconds: float, why: str) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            assert httpx.get(url, timeout=1, trust_env=False).status_code == 200
            return
        except httpx.TransportError:
            assert time.monotonic() < deadline, why
            time.sleep(0.2)


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


@needs_netns
def test_a_cut_link_is_silent_and_a_mended_one_serves_again() -> None:
    """A server inside a worker namespace answers through the bridge; cut, a request times
    out (no reset, no refusal); mended, it answers again; remove() leaves nothing behind."""
    network = WorkerNetwork(_port := 17011)
    address = network.address("decode-0")
    server = None
    try:
        network.create()
        server = subprocess.Popen(
            [*network.exec_prefix("decode-0"), sys.executable, "-m", "http.server", "8080",
             "--bind", address], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://{address}:8080/"
        _wait_answering(url, 20, "the server in the namespace never answered")
        network.cut("decode-0")
        started = time.monotonic()
        try:
            httpx.get(url, timeout=1.5, trust_env=False)
            raise AssertionError("a cut link answered")
        except httpx.TimeoutException:
            pass  # silence, not a refused connection
        assert time.monotonic() - started >= 1.4
        network.mend("decode-0")
        _wait_answering(url, 10, "the mended link never answered")
    finally:
        if server is not None:
            server.kill()
            server.wait()
        network.remove()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"tandem-{_port}-" not in namespaces and f"tnd{_port}" not in _links()
