"""A free TCP port, asked of the kernel: every process that starts a listener of its own (a
cluster's workers, a local Redis, the engine's rank rendezvous, the benches, the tests) picks its
port here, so there is one way to do it."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` right now (IPv6 when the host has a colon). The
    socket closes before the port is used, so another process could take it first: callers that
    start a server check it came up."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
