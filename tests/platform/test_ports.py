"""free_port: a port the caller can listen on right away, on IPv4 and (where the host has it)
IPv6."""

from __future__ import annotations

import socket

import pytest

from tandem.platform.ports import free_port


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_port_is_free_to_listen_on(host: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if family == socket.AF_INET6 and not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    port = free_port(host)
    assert 0 < port < 65536
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, port))
        sock.listen()


def test_a_port_in_use_is_not_given() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert all(free_port() != taken for _ in range(50))
