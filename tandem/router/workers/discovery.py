"""Worker discovery from DNS: a Kubernetes headless Service lists one A record per ready pod.

`tandem route --discover prefill=tandem-prefill.NS.svc.cluster.local:8000` re-resolves the
name every `--discover-interval` seconds and adopts its addresses as prefill workers, beside
any given by flag or file. Kubernetes publishes only pods whose readiness probe passes, and a
draining worker fails its probe (/health turns 503), so pods join when ready and leave when
they start draining, with no router restart and no Kubernetes API access (no RBAC).

A name that does not exist (a headless Service with no ready pod has no records) means no
workers of that role; a lookup that fails for another reason (the resolver timed out) keeps
the last answer, so a DNS hiccup does not empty a pool.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from tandem.router.config import DiscoveryTarget, WorkerSpec

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]

# "No such name" and "no address for it": the Service has no ready endpoint right now.
_NO_RECORDS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address the system resolver returns for `host` (A and AAAA records, /etc/hosts)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class DnsDiscovery:
    """The workers the targets' names resolve to, as of the last `refresh`."""

    def __init__(self, targets: tuple[DiscoveryTarget, ...], resolver: Resolver = resolve_addresses) -> None:
        self.targets = targets
        self._resolver = resolver
        self._found: dict[DiscoveryTarget, tuple[WorkerSpec, ...]] = {t: () for t in targets}

    @property
    def specs(self) -> tuple[WorkerSpec, ...]:
        return tuple(spec for target in self.targets for spec in self._found[target])

    async def refresh(self) -> bool:
        """Resolve every target again; True when the set of workers changed."""
        before = self.specs
        for target in self.targets:
            try:
                addresses = await self._resolver(target.host, target.port)
            except socket.gaierror as exc:
                if exc.errno not in _NO_RECORDS:
                    logger.warning("discovery: cannot resolve %s (%s); keeping its %d workers",
                                   target.describe(), exc, len(self._found[target]))
                    continue
                addresses = []
            specs = tuple(WorkerSpec(target.url(a), target.role) for a in sorted(set(addresses)))
            if specs != self._found[target]:
                logger.info("discovery: %s resolves to %d worker(s): %s", target.describe(), len(specs),
                            ", ".join(s.url for s in specs) or "none")
            self._found[target] = specs
        return self.specs != before
