"""Where a cluster's cached tokens came from: a real `tandem route` in front of the shared
`tandem serve` (the ``tandem_server`` fixture), read after a repeated prompt, and the sums."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tandem.bench.cluster_stats import describe, snapshot_workers, summarize
from tandem.platform.ports import free_port


@pytest.fixture
def router(tandem_server: str, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    with (tmp_path / "route.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tandem", "route", "--port", str(port), "--worker", tandem_server,
             "--no-ledger", "--health-interval", "0.2"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "route.log").read_text()
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(30)


def test_a_snapshot_reads_every_workers_load_through_the_router(router: str, tandem_server: str) -> None:
    body = {"model": "smollm2-135m", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "A prompt sent twice. " * 20}]}
    before = summarize(snapshot_workers(router))
    for _ in range(2):
        assert httpx.post(f"{router}/v1/chat/completions", json=body, timeout=60).status_code == 200
    snapshot = snapshot_workers(router)
    assert [w["url"] for w in snapshot] == [tandem_server]
    after = summarize(snapshot)
    assert after["workers"] == 1 and after["unreachable"] == 0
    # The second request found the first one's whole blocks on the device.
    assert after["prompt_tokens"] > before["prompt_tokens"]
    assert after["device_hit_tokens"] - before["device_hit_tokens"] >= 16
    assert after["loaded_tokens"] == before["loaded_tokens"] == 0  # no tier, no handoff
    assert describe(after).startswith("device ")


def test_summarize_adds_up_the_tiers_and_counts_unreachable_workers() -> None:
    def worker(hits: int, loaded: int, cluster_hits: int, dropped: int) -> dict:
        return {"url": "http://w", "load": {
            "prefix_cache_queries": 1000, "prefix_cache_hits": hits, "connector_loaded_tokens": loaded,
            "kv_tiers": {"chunk_misses": 1, "loads": 2, "loads_skipped_by_cost": 1, "writer": {"dropped": dropped},
                         "media": {"cpu": {"chunk_hits": 3}, "cluster": {"chunk_hits": cluster_hits, "corrupt": 1}}}}}

    total = summarize([worker(500, 300, 2, 0), worker(600, 200, 1, 4), {"url": "http://x", "error": "refused"}])
    assert (total["workers"], total["unreachable"]) == (3, 1)
    assert (total["prompt_tokens"], total["device_hit_tokens"], total["loaded_tokens"]) == (2000, 1100, 500)
    assert total["chunk_hits"] == {"cpu": 6, "disk": 0, "cluster": 3}
    assert (total["chunk_misses"], total["loads_skipped_by_cost"], total["writes_dropped"], total["corrupt"]) == (
        2, 2, 4, 2)
    assert describe(total) == (
        "device 55.0% + tiers 25.0% of 2000 prompt tokens; chunk loads: cpu 6, cluster 3; requests that loaded "
        "nothing: 2 in no tier, 2 skipped by cost; 4 writes dropped, 2 corrupt chunks, 1 workers unreachable")
