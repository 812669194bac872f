"""Workers on their own network, as if each ran on its own host: `tandem up --netns`.

`tandem up` puts every process on 127.0.0.1, where a link cannot fail on its own: a worker
is either there or dead. With `--netns` each worker runs in a Linux network namespace of its
own, joined to the router by a veth pair on one bridge:

    router (this namespace) -- bridge 10.A.B.1/24 -- veth -- [netns] worker at 10.A.B.k

so the router reaches it, and the workers reach each other (the KV handoff), only over that
link. `cut(worker)` takes the worker's end of the link down: packets in both directions then
vanish without a reset or a FIN, which is what a pulled cable or a partitioned switch does
and what a SIGKILL cannot show (`tandem bench chaos` uses it). `mend(worker)` brings it back.

Needs root (CAP_NET_ADMIN) and iproute2's `ip`. Names are derived from the router's port, so
two clusters on one host do not collide and a crashed run's leftovers are replaced on the next
start. The subnet is 10.A.B.0/24 with A.B from the port; one already routed on this host is
refused rather than shadowed.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_IP = "ip"


class NetnsError(OSError):
    """The host cannot build the network (not root, no `ip`, a clashing subnet)."""


def available() -> str | None:
    """None when namespaces can be made here; else why not, in words."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    if shutil.which(_IP) is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    return None


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([_IP, *argv], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise NetnsError(f"ip {' '.join(argv)}: {result.stderr.strip() or result.returncode}")
    return result


@dataclass
class WorkerNetwork:
    """One cluster's bridge and its workers' namespaces (names from the router's port)."""

    port: int
    members: dict[str, int] = field(default_factory=dict)  # worker name -> host number

    @property
    def bridge(self) -> str:
        return f"tnd{self.port}br"

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"10.{(self.port >> 8) & 255}.{self.port & 255}.0/24")

    @property
    def gateway(self) -> str:
        return str(self.subnet.network_address + 1)

    def namespace(self, worker: str) -> str:
        return f"tandem-{self.port}-{worker}"

    def address(self, worker: str) -> str:
        """The worker's address; it is given one on first use."""
        if worker not in self.members:
            if len(self.members) >= 250:
                raise NetnsError("at most 250 workers per cluster network")
            self.members[worker] = len(self.members) + 2
        return str(self.subnet.network_address + self.members[worker])

    def _host_veth(self, worker: str) -> str:
        return f"tnd{self.port}h{self.members[worker]}"

    def exec_prefix(self, worker: str) -> list[str]:
        """Prepended to a worker's command line: it starts inside its namespace (`ip netns
        exec` replaces itself with the command, so the pid stays the worker's)."""
        return [_IP, "netns", "exec", self.namespace(worker)]

    # --- building and removing ---------------------------------------------------------
    def create(self) -> None:
        """The bridge and one namespace per member; leftovers of an earlier run go first."""
        reason = available()
        if reason:
            raise NetnsError(reason)
        self.remove()
        self._check_subnet_free()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for worker in self.members:
            self._add_member(worker)
        logger.info(
            "worker network: bridge %s on %s, %d namespaces (%s)",
            self.bridge,
            self.subnet,
            len(self.members),
            ", ".join(f"{w} {self.address(w)}" for w in self.members),
        )

    def _add_member(self, worker: str) -> None:
        namespace, host, inner = self.namespace(worker), self._host_veth(worker), "eth0"
        _ip("netns", "add", namespace)
        _ip("link", "add", host, "type", "veth", "peer", "name", f"{host}n")
        _ip("link", "set", f"{host}n", "netns", namespace)
        _ip("-n", namespace, "link", "set", f"{host}n", "name", inner)
        _ip("-n", namespace, "addr", "add", f"{self.address(worker)}/24", "dev", inner)
        _ip("-n", namespace, "link", "set", inner, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("link", "set", host, "master", self.bridge)
        _ip("link", "set", host, "up")

    def _check_subnet_free(self) -> None:
        routes = _ip("-4", "route", "show").stdout.splitlines()
        for line in routes:
            target = line.split(" ", 1)[0]
            if target == "default":
                continue
            try:
                if ipaddress.IPv4Network(target, strict=False).overlaps(self.subnet):
                    raise NetnsError(
                        f"{self.subnet} (from router port {self.port}) is already routed on this "
                        f"host ({line.strip()}); pick another --port"
                    )
            except ValueError:
                continue

    def remove(self) -> None:
        """Every namespace and link of this cluster's names; quiet about what is not there.
        Processes still inside a namespace keep it alive until they exit."""
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            name = line.split(" ", 1)[0]
            if name.startswith(f"tandem-{self.port}-"):
                _ip("netns", "delete", name, check=False)
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
            parts = line.split(": ", 2)
            if len(parts) > 1:
                name = parts[1].split("@", 1)[0]
                if name.startswith(f"tnd{self.port}h") or name == self.bridge:
                    _ip("link", "delete", name, check=False)

    # --- faults --------------------------------------------------------------------------
    def cut(self, worker: str) -> None:
        """The worker's end of its link goes down: nothing in or out, no resets."""
        _ip("-n", self.namespace(worker), "link", "set", "eth0", "down")

    def mend(self, worker: str) -> None:
        _ip("-n", self.namespace(worker), "link", "set", "eth0", "up")
