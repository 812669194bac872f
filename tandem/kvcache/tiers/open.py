"""Opening the slow tiers' stores from the engine's KV tier settings."""

from __future__ import annotations

from tandem.config import EngineConfig
from tandem.kvcache.tiers.store import ChunkStore


def open_stores(config: EngineConfig, role: str, rank: int = 0) -> dict[str, ChunkStore]:
    """The slow tiers' stores. `role` "probe": the scheduler side's (existence checks only);
    "worker": the worker side's (reads, writes, and the disk tier's budget)."""
    tiers = config.kv_tiers
    stores: dict[str, ChunkStore] = {}
    if tiers.disk_path:
        from tandem.kvcache.tiers.disk import DiskStore

        if role == "probe":
            stores["disk"] = DiskStore.prober(tiers.disk_path)
        else:
            stores["disk"] = DiskStore(tiers.disk_path, tiers.disk_bytes)
    if tiers.store_url:
        stores["cluster"] = open_cluster_store(
            tiers.store_url, probe=role == "probe", secret=config.kv_transfer.secret
        )
    return stores


def open_cluster_store(url: str, probe: bool = False, secret: str | None = None) -> ChunkStore:
    """The cluster store at `url`; `probe`: only for existence checks (a Mooncake prober
    contributes no memory segment of its own). `secret`, the cluster's, is Redis's password
    unless the URL names one (the redis-server `tandem up` starts requires it; a server
    without a password ignores it)."""
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("redis", "rediss", "valkey", "unix"):
        from tandem.kvcache.tiers.redis_store import RedisStore

        return RedisStore(url, password=secret)
    if scheme == "mooncake":
        from tandem.kvcache.tiers.mooncake_store import MooncakeStore

        return MooncakeStore.prober(url) if probe else MooncakeStore(url)
    raise ValueError(f"--kv-store {url!r}: expected redis://HOST:PORT, valkey://HOST:PORT or mooncake://...")
