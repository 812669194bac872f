"""The cluster KV tier on Mooncake Store: every worker writes chunks, any worker reads them.

`--kv-store mooncake://MASTER_HOST:PORT[?OPTIONS]` (see `MooncakeConfig.from_url`). Mooncake
differs from Redis in ways that shape this class:

* There is no server holding the data. `mooncake_master` (mooncake_master.py starts one) keeps
  only metadata; the bytes live in *segments*, memory that each client process contributes
  (`segment=`, 1 GiB by default) and serves to the others over its transfer engine (TCP here,
  RDMA where available). The master places each value in some client's segment, not
  necessarily the writer's, and when a process leaves, the values in its segment vanish,
  whoever wrote them (at once on a clean close; after a crash once its heartbeat lapses, about
  10 s, and until then they are listed but unreadable, which `get` reports as an error). For a
  cache that is fine: a lost chunk is a recompute. A client with `segment=0` contributes
  nothing and still reads and writes the others' segments; the scheduler's prober is one.
* `put` does not overwrite an existing key (it returns 0 and keeps the old value), so writes go
  through `upsert`. Each value is staged through the client's local transfer buffer
  (`buffer=`, 64 MiB by default), so the buffer must exceed the largest chunk (about 12 MiB
  for the default model); a larger value fails with INVALID_PARAMS (-600). Calls on one
  client share that buffer, so concurrent calls can starve each other into the same error:
  this class serialises them with a lock (the binding releases the GIL while it works, and
  nothing in Mooncake's documentation promises more than that).
* A full store fails a write with NO_AVAILABLE_HANDLE (-200) until the master's eviction
  (periodic: a share of the objects once usage passes a high watermark) makes room; the write
  is reported as failed and the chunk is simply not cached. Steady writes keep up (12 MiB at
  20/s into 256 MiB: none refused, the oldest evicted); a back-to-back burst does not (30-70%
  of 100 refused).
* A read takes a lease on the object (10 s by default) and a plain `remove` of a leased object
  fails (-706), so `delete` forces the removal.
* `setup()` against an unreachable master retries for about 90 s before it gives up, and a
  call whose master has gone blocks for its RPC timeout (about 4 s) before it returns RPC_FAIL.
  So the constructor first probes the master's port with a short TCP connect and fails at once
  when it is closed, and after an RPC failure the store backs off for `backoff_s` like
  RedisStore (calls fail at once), re-probing the port before it tries the master again. `get`
  answers a miss and a failure alike (empty bytes), so an empty answer is checked: a probe of
  the port, then `is_exist` (absent: None; present or failing: ChunkStoreError).
* The client logs through glog to stderr: a dozen INFO lines per setup, and a warning per
  write refused for space. `MC_LOG_LEVEL` defaults to ERROR here, set before the library loads
  (it reads the variable once; an explicit MC_LOG_LEVEL wins). Errors still show, among them
  harmless ones: "WARNING: Logging before InitGoogleLogging() ..." once per process and
  "E... transfer_metadata.cpp:...] Local segment descriptor not found" once per setup.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from urllib.parse import parse_qsl, urlparse

from tandem.config import parse_memory_size
from tandem.kvcache.tiers.store import ChunkStore, ChunkStoreError

PIP_PACKAGE = "mooncake-transfer-engine-non-cuda"
APT_PACKAGES = ("libibverbs1", "libnuma1", "libcurl4")
INSTALL_HINT = (f"install it with `pip install {PIP_PACKAGE}` (mooncake-transfer-engine on a "
                f"CUDA host; scripts/setup.sh does) and the system libraries it loads, "
                f"`apt-get install {' '.join(APT_PACKAGES)}`")

# Mooncake's ErrorCode (mooncake-store/include/types.h), the ones a byte store meets.
ERROR_NAMES = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND", -200: "NO_AVAILABLE_HANDLE (the store is full)",
    -400: "INVALID_KEY", -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS (a value larger than the local buffer?)", -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE", -701: "INVALID_READ", -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED", -800: "TRANSFER_FAIL", -900: "RPC_FAIL (master unreachable)",
    -901: "RPC_TIMEOUT", -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
}
_RPC_FAIL = -900
_DOWN_CODES = frozenset({_RPC_FAIL, -901})  # the master cannot be reached: back off
_NOT_FOUND = -704

DEFAULT_PORT = 50051


def error_name(code: int) -> str:
    return ERROR_NAMES.get(code, "unknown error")


def import_client() -> type:
    """The binding's MooncakeDistributedStore class, logging errors only unless MC_LOG_LEVEL says
    otherwise (the library reads it once, when it loads); ChunkStoreError when not installed."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ChunkStoreError(f"the Mooncake client is not importable ({exc}): "
                              f"{INSTALL_HINT}") from exc
    return MooncakeDistributedStore


def local_address_towards(host: str, port: int) -> str:
    """The address this host uses to reach `host` (what other clients will connect back to),
    found by connecting a UDP socket (no packet is sent); 127.0.0.1 when there is no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((host, port))
            return sock.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def master_reachable(host: str, port: int, timeout: float) -> str | None:
    """None when the master's RPC port accepts a TCP connection, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return str(exc) or type(exc).__name__


@dataclass(frozen=True)
class MooncakeConfig:
    host: str
    port: int = DEFAULT_PORT
    segment_bytes: int = 1 << 30
    buffer_bytes: int = 64 << 20
    metadata: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    rdma_devices: str = ""
    local_hostname: str | None = None  # None: the address that reaches the master
    prefix: str = "tandem:kv:"

    @property
    def master_addr(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_url(cls, url: str) -> MooncakeConfig:
        """mooncake://HOST[:PORT][?OPTIONS], OPTIONS among segment=1GiB, buffer=64MiB,
        metadata=P2PHANDSHAKE (or http://H:P/metadata), protocol=tcp (or rdma),
        rdma_devices=mlx5_0,..., local_hostname=ADDR, prefix=tandem:kv: (the defaults shown)."""
        parsed = urlparse(url)
        if parsed.scheme.lower() != "mooncake" or not parsed.hostname:
            raise ValueError(f"not a Mooncake URL: {url!r} "
                             "(expected mooncake://MASTER_HOST:PORT)")
        try:
            port = parsed.port or DEFAULT_PORT
        except ValueError as exc:
            raise ValueError(f"{url!r}: {exc}") from exc
        config = cls(host=parsed.hostname, port=port)
        fields = {"segment": "segment_bytes", "buffer": "buffer_bytes", "metadata": "metadata",
                  "protocol": "protocol", "rdma_devices": "rdma_devices",
                  "local_hostname": "local_hostname", "prefix": "prefix"}
        changes: dict[str, object] = {}
        for name, value in parse_qsl(parsed.query, keep_blank_values=True):
            if name not in fields:
                raise ValueError(f"{url!r}: unknown option {name!r} "
                                 f"(known: {', '.join(fields)})")
            sized = name in ("segment", "buffer")
            changes[fields[name]] = parse_memory_size(value) if sized else value
        return replace(config, **changes)


class MooncakeStore(ChunkStore):
    medium = "cluster"

    def __init__(self, url: str, *, segment_bytes: int | None = None,
                 buffer_bytes: int | None = None, connect_timeout: float = 0.5,
                 backoff_s: float = 1.0) -> None:
        config = MooncakeConfig.from_url(url)
        if segment_bytes is not None:
            config = replace(config, segment_bytes=segment_bytes)
        if buffer_bytes is not None:
            config = replace(config, buffer_bytes=buffer_bytes)
        self.config = config
        self.url = url
        self.prefix = config.prefix
        self.connect_timeout = connect_timeout
        self.backoff_s = backoff_s
        self.local_hostname = (config.local_hostname
                               or local_address_towards(config.host, config.port))
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._counters = {"puts": 0, "gets": 0, "hits": 0, "errors": 0, "bytes_written": 0,
                          "bytes_read": 0}
        self._store = None

        why = master_reachable(config.host, config.port, connect_timeout)
        if why is not None:
            raise ChunkStoreError(f"cluster store {url}: no Mooncake master at "
                                  f"{config.master_addr} ({why})")
        store = import_client()()
        code = store.setup(self.local_hostname, config.metadata, config.segment_bytes,
                           config.buffer_bytes, config.protocol, config.rdma_devices,
                           config.master_addr)
        if code != 0:
            with contextlib.suppress(Exception):
                store.close()
            raise ChunkStoreError(f"cluster store {url}: Mooncake setup failed with code {code} "
                                  f"({error_name(code)}) as {self.local_hostname}")
        self._store = store

    @classmethod
    def prober(cls, url: str, **kwargs: float) -> MooncakeStore:
        """A client that contributes no memory and has no transfer buffer: existence checks only
        (the scheduler's side); its put and get fail with ChunkStoreError."""
        return cls(url, segment_bytes=0, buffer_bytes=0, **kwargs)

    def _fail(self, what: str, code: int | None = None) -> ChunkStoreError:
        with self._lock:
            self._counters["errors"] += 1
            if code in _DOWN_CODES:
                self._down_until = time.monotonic() + self.backoff_s
        detail = f": code {code} ({error_name(code)})" if code is not None else ""
        return ChunkStoreError(f"cluster store {self.url}: {what}{detail}")

    def _call(self, method: str, *args):  # noqa: ANN202 - a thin wrapper
        """One binding call, under the lock; fails at once while backing off, and once the
        back-off has passed probes the master's port before paying an RPC timeout on it."""
        if self._down_until:
            if time.monotonic() < self._down_until:
                raise ChunkStoreError(f"cluster store {self.url} is backing off after a failure")
            why = master_reachable(self.config.host, self.config.port, self.connect_timeout)
            with self._lock:
                self._down_until = time.monotonic() + self.backoff_s if why else 0.0
                if why:
                    self._counters["errors"] += 1
            if why:
                raise ChunkStoreError(f"cluster store {self.url}: master {self.config.master_addr} "
                                      f"unreachable ({why})")
        with self._lock:
            if self._store is None:
                raise ChunkStoreError(f"cluster store {self.url} is closed")
            return getattr(self._store, method)(*args)

    def _check_buffer(self) -> None:
        if self.config.buffer_bytes == 0:
            raise ChunkStoreError(f"cluster store {self.url}: a client without a transfer buffer "
                                  "(a prober) cannot read or write values")

    def put(self, key: str, value: bytes | bytearray | memoryview) -> None:
        self._check_buffer()
        code = self._call("upsert", self.prefix + key, value)
        size = value.nbytes if isinstance(value, memoryview) else len(value)
        if code != 0:
            raise self._fail(f"upsert of {size} bytes under {key!r}", code)
        with self._lock:
            self._counters["puts"] += 1
            self._counters["bytes_written"] += size

    def get(self, key: str) -> bytes | None:
        self._check_buffer()
        value = self._call("get", self.prefix + key)
        if not value:  # a miss, or a failure the binding reports the same way: ask the master,
            # after a cheap check that it is there at all (an RPC to a dead one takes seconds)
            why = master_reachable(self.config.host, self.config.port, self.connect_timeout)
            if why is not None:
                raise self._fail(f"get of {key!r}: master {self.config.master_addr} unreachable "
                                 f"({why})", _RPC_FAIL)
            present = self._call("is_exist", self.prefix + key)
            if present < 0:
                raise self._fail(f"get of {key!r}", present)
            if present:
                raise self._fail(f"get of {key!r}: listed but unreadable (its owner may have gone)")
            value = None
        with self._lock:
            self._counters["gets"] += 1
            if value is not None:
                self._counters["hits"] += 1
                self._counters["bytes_read"] += len(value)
        return value

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        codes = self._call("batch_is_exist", [self.prefix + key for key in keys])
        failed = next((code for code in codes if code < 0), None)
        if failed is not None:
            raise self._fail(f"is_exist of {len(keys)} keys", failed)
        return [code == 1 for code in codes]

    def delete(self, key: str) -> None:
        code = self._call("remove", self.prefix + key, True)  # force: past a read's lease
        if code not in (0, _NOT_FOUND):
            raise self._fail(f"remove of {key!r}", code)

    def close(self) -> None:
        """Leave the cluster: the values in this client's segment go with it. Takes 1-2 s."""
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()

    def stats(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counters)
