"""Several "hosts" on one machine: Linux network namespaces on one bridge (needs root).

Each namespace gets a veth into the bridge and an address of its own on 10.77.x.0/24; the
test's own namespace is .1 on the bridge. Traffic between them crosses real interfaces, as
between machines: nothing binds 127.0.0.1 by accident.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

needs_netns = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                 reason="network namespaces need root and iproute2 (CI has both)")


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@dataclass
class Hosts:
    """Namespaces by name, each with an address on one bridge; the test's side is .1."""

    prefix: str
    addresses: dict[str, str]
    bridge: str

    def exec(self, name: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", f"{self.prefix}{name}")


@contextmanager
def make_hosts(names: list[str], tag: str) -> Iterator[Hosts]:
    """Namespaces `names` on a fresh bridge; `tag` (a few letters) keeps concurrent users apart."""
    unique = f"{tag}{os.getpid() % 10000}"
    prefix, bridge = f"{unique}-", f"{unique}br"
    subnet = f"10.77.{(os.getpid() + sum(map(ord, tag))) % 250}"
    created: list[str] = []
    try:
        sh("ip", "link", "add", bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{subnet}.1/24", "dev", bridge)
        sh("ip", "link", "set", bridge, "up")
        addresses = {}
        for index, name in enumerate(names, start=2):
            ns, veth = f"{prefix}{name}", f"{unique}v{index}"
            sh("ip", "netns", "add", ns)
            created.append(ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "link", "set", veth, "master", bridge)
            sh("ip", "link", "set", veth, "up")
            address = f"{subnet}.{index}"
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            addresses[name] = address
        yield Hosts(prefix, addresses, bridge)
    finally:
        for ns in created:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        subprocess.run(["ip", "link", "delete", bridge], capture_output=True)
