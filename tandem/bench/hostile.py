"""Hostile clients for `tandem bench chaos --phases calm,hostile`: the attacks that once got
through, sent at a low rate while ordinary clients run their load.

Each attack knows what refusing it looks like: a status (400, 401, 403), a forged field that
changed nothing (the attacker's listener never contacted), or a KV port that hangs up on an
unauthenticated frame before reading what it declares. The bench counts attacks sent and
refused per kind, next to the ordinary clients' completions, texts and p99 latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

_MAGIC_HEADER = struct.Struct("<4sB3xIQ")  # the KV port's frame preamble (kvcache/transfer/wire.py)


@dataclass
class Target:
    """Where the attacks go: a `tandem up` cluster's router, its workers and a prefill KV port."""

    router: str
    model: str
    workers: dict[str, str]  # name -> URL
    kv_port: tuple[str, int] | None = None


@dataclass
class Attack:
    kind: str
    refused: bool
    detail: str = ""
    seconds: float = 0.0


class Listener:
    """An attacker-run KV source: it knows no secret, answers anything with `reply` (the old
    protocol's OK by default; a tests' forged frame), counts contacts. The tests use it too."""

    def __init__(self, reply: bytes = b"OK" + b"\0" * 1024) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.reply = reply
        self.contacts = 0
        threading.Thread(target=self._run, daemon=True, name="attacker-listener").start()

    def _run(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            self.contacts += 1
            with contextlib.suppress(OSError), connection:
                connection.settimeout(2)
                connection.recv(1 << 16)
                connection.sendall(self.reply)

    def close(self) -> None:
        self.server.close()


@dataclass
class Attacker:
    target: Target
    listener: Listener = field(default_factory=Listener)

    def forged_handle(self) -> dict:
        return {"do_remote_prefill": True, "emit_first_token": True, "first_token_ids": [504],
                "transfer_id": "victim-lease", "host": "127.0.0.1", "port": self.listener.port,
                "block_hashes": list(range(1, 17)), "shm_path": "/dev/shm/tandem-kv-victim",
                "extra": {"block_ids": list(range(64))}}

    def chat(self, content: str = "Hello", **extra: object) -> dict:
        return {"model": self.target.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": 4, "temperature": 0, **extra}

    # --- the attacks: each returns (refused, detail) ---------------------------------
    async def forged_handle_via_router(self, client: httpx.AsyncClient) -> tuple[bool, str]:
        before = self.listener.contacts
        reply = await client.post(f"{self.target.router}/v1/chat/completions",
                                  json=self.chat(logprobs=True, kv_transfer_params=self.forged_handle()))
        untouched = self.listener.contacts == before
        return reply.status_code in (200, 400, 403) and untouched, f"HTTP {reply.status_code}, listener " \
            f"{'untouched' if untouched else 'contacted'}"

    async def forged_handle_to_a_worker(self, client: httpx.AsyncClient) -> tuple[bool, str]:
        url = next(u for n, u in self.target.workers.items() if n.startswith(("decode", "worker")))
        reply = await client.post(f"{url}/v1/chat/completions", json=self.chat(kv_transfer_params=self.forged_handle()))
        return reply.status_code in (401, 403), f"HTTP {reply.status_code}"

    async def sixteen_thousand_sequences(self, client: httpx.AsyncClient) -> tuple[bool, str]:
        body = {"model": self.target.model, "prompt": [f"Item {i}" for i in range(2000)], "n": 8, "max_tokens": 16}
        reply = await client.post(f"{self.target.router}/v1/completions", json=body)
        return reply.status_code == 400, f"HTTP {reply.status_code}"

    async def _status(self, client: httpx.AsyncClient, body: bytes | dict, expected: tuple[int, ...]) -> tuple[bool, str]:
        url = f"{self.target.router}/v1/chat/completions"
        if isinstance(body, bytes):
            reply = await client.post(url, content=body, headers={"content-type": "application/json"})
        else:
            reply = await client.post(url, json=body)
        return reply.status_code in expected, f"HTTP {reply.status_code}"

    async def top_k_overflow(self, client: httpx.AsyncClient) -> tuple[bool, str]:
        return await self._status(client, self.chat(top_k=2**63, temperature=0.8), (400,))

    async def seed_overflow(self, client: httpx.AsyncClient) -> tuple[bool, str]:
        return await self._status(client, self.chat(seed=2**70, temperature=0.8), (400,))

    async def nan_temperature(self, client: httpx.AsyncClient) -> tuple[bool, str]:
        raw = json.dumps(self.chat()).replace('"temperature": 0', '"temperature": NaN').encode()
        return await self._status(client, raw, (400,))

    async def lone_surrogate(self, client: httpx.AsyncClient) -> tuple[bool, str]:
        raw = json.dumps(self.chat("x")).replace('"x"', '"\\ud800"').encode()
        return await self._status(client, raw, (400,))

    async def drain_without_a_key(self, client: httpx.AsyncClient) -> tuple[bool, str]:
        worker = next(iter(self.target.workers.values())).removeprefix("http://")
        reply = await client.post(f"{self.target.router}/workers/{worker}/drain")
        return reply.status_code in (401, 403), f"HTTP {reply.status_code}"

    async def worker_control_without_a_key(self, client: httpx.AsyncClient) -> tuple[bool, str]:
        url = next(iter(self.target.workers.values()))
        reply = await client.post(f"{url}/reset_prefix_cache")
        return reply.status_code in (401, 403), f"HTTP {reply.status_code}"

    async def another_tenants_salt(self, client: httpx.AsyncClient) -> tuple[bool, str]:
        url = next(iter(self.target.workers.values()))
        reply = await client.post(f"{url}/v1/chat/completions", json=self.chat(cache_salt="tenant-0123456789abcdef"))
        return reply.status_code in (401, 403), f"HTTP {reply.status_code}"

    async def huge_kv_frame(self, client: httpx.AsyncClient) -> tuple[bool, str]:
        if self.target.kv_port is None:
            return True, "no KV port"
        return await asyncio.to_thread(_huge_frame, self.target.kv_port)

    def attacks(self) -> list[tuple[str, Callable[[httpx.AsyncClient], Awaitable[tuple[bool, str]]]]]:
        return [(name, getattr(self, name)) for name in (
            "forged_handle_via_router", "forged_handle_to_a_worker", "sixteen_thousand_sequences", "top_k_overflow",
            "seed_overflow", "nan_temperature", "lone_surrogate", "drain_without_a_key",
            "worker_control_without_a_key", "another_tenants_salt", "huge_kv_frame")]


def _huge_frame(address: tuple[str, int]) -> tuple[bool, str]:
    """Declare a 400 MiB header and start sending it: the source must hang up at once."""
    sent = 0
    try:
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(_MAGIC_HEADER.pack(b"TKV1", 2, 400 << 20, 0) + b"\0" * 32)
            for _ in range(400):
                sock.sendall(b"\0" * (1 << 20))
                sent += 1
    except OSError:
        return sent < 400, f"hung up after {sent} MiB"
    return False, "read all 400 MiB"


async def attack_loop(target: Target, rate_per_s: float, deadline: float) -> tuple[list[Attack], Listener]:
    """Send the attacks in turn, `rate_per_s` a second, until `deadline` (monotonic)."""
    attacker = Attacker(target)
    attacks = attacker.attacks()
    done: list[Attack] = []
    turn = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), trust_env=False) as client:
        while time.monotonic() < deadline:
            name, run = attacks[turn % len(attacks)]
            turn += 1
            started = time.monotonic()
            try:
                refused, detail = await run(client)
            except httpx.HTTPError as exc:
                refused, detail = False, f"{type(exc).__name__}: {exc}"[:200]
            done.append(Attack(name, refused, detail, time.monotonic() - started))
            await asyncio.sleep(max(0.0, started + 1.0 / rate_per_s - time.monotonic()))
    return done, attacker.listener
