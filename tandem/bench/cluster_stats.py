"""Where a launched cluster's cached prompt tokens came from, read off its workers after a run.

The client sees only ``cached_tokens``; a tier set's result is explained by the workers' own
counters: how many prompt tokens each found on its device pool, how many it loaded from a
lower tier (and from which), and why it computed the rest where a tier might have served it
(a chunk in no tier, a load the cost model skipped, one that timed out or failed, a write the
writer dropped). A PD cluster's decode workers also say what the handoff moved: pulls,
tokens, bytes a token (the --kv-transfer-dtype codec's) and time a pull. ``snapshot_workers`` asks the router for its workers and each worker for its
``/load``; ``summarize`` adds them up. Only launched clusters are asked: a URL target may be
anything.
"""

from __future__ import annotations

from typing import Any

import httpx

from tandem.trust.peer import peer_client

_TIER_MEDIA = ("cpu", "disk", "cluster")


def snapshot_workers(router_url: str, timeout_s: float = 10.0, secret: str | None = None) -> list[dict[str, Any]]:
    """Each worker behind the router: its URL and a fresh ``/load`` (or the error getting it);
    `secret`: the cluster's, whose workers answer only signed requests."""
    with httpx.Client(timeout=timeout_s) as client, peer_client(secret, timeout=timeout_s) as workers_client:
        workers = client.get(f"{router_url.rstrip('/')}/workers").json().get("workers", [])
        snapshot = []
        for worker in workers:
            url = worker.get("url", "")
            try:
                response = workers_client.get(f"{url.rstrip('/')}/load")
                response.raise_for_status()
                snapshot.append({"url": url, "load": response.json()})
            except (httpx.HTTPError, ValueError) as exc:
                snapshot.append({"url": url, "error": str(exc)})
        return snapshot


def summarize(snapshot: list[dict[str, Any]]) -> dict[str, Any]:
    """Cluster totals: prompt tokens looked up, found on the device, loaded from the tiers;
    chunk hits per tier and the reasons chunks were computed instead."""
    total: dict[str, Any] = {
        "workers": len(snapshot), "unreachable": 0, "prompt_tokens": 0, "device_hit_tokens": 0,
        "loaded_tokens": 0, "chunk_hits": dict.fromkeys(_TIER_MEDIA, 0), "chunk_misses": 0,
        "loads": 0, "loads_skipped_by_cost": 0, "loads_timed_out": 0, "loads_failed": 0,
        "probe_errors": 0, "writes_dropped": 0, "corrupt": 0,
        "handoff": {"pulls": 0, "tokens_received": 0, "bytes_received": 0, "pull_seconds": 0.0},
    }
    for worker in snapshot:
        load = worker.get("load")
        if load is None:
            total["unreachable"] += 1
            continue
        total["prompt_tokens"] += int(load.get("prefix_cache_queries", 0))
        total["device_hit_tokens"] += int(load.get("prefix_cache_hits", 0))
        total["loaded_tokens"] += int(load.get("connector_loaded_tokens", 0))
        transfer = load.get("kv_transfer") or {}
        if transfer.get("bytes_received"):  # a decode worker's pulls (prefill workers send)
            handoff, per_token = total["handoff"], float(transfer.get("bytes_per_token_received") or 0)
            handoff["pulls"] += int(transfer.get("pulls", 0))
            handoff["bytes_received"] += int(transfer["bytes_received"])
            handoff["tokens_received"] += round(transfer["bytes_received"] / per_token) if per_token else 0
            handoff["pull_seconds"] += float(transfer.get("pull_seconds", 0.0))
        tiers = load.get("kv_tiers") or {}
        for key in ("chunk_misses", "loads", "loads_skipped_by_cost", "loads_timed_out", "loads_failed",
                    "probe_errors"):
            total[key] += int(tiers.get(key, 0))
        total["writes_dropped"] += int((tiers.get("writer") or {}).get("dropped", 0))
        for medium, values in (tiers.get("media") or {}).items():
            if medium in total["chunk_hits"]:
                total["chunk_hits"][medium] += int(values.get("chunk_hits", 0))
                total["corrupt"] += int(values.get("corrupt", 0))
    return total


def describe(summary: dict[str, Any]) -> str:
    """One line: the share of prompt tokens from the device and from the tiers, and the misses."""
    prompt = summary["prompt_tokens"]
    if not prompt:
        return "no prompt tokens reported"
    hits = ", ".join(f"{m} {n}" for m, n in summary["chunk_hits"].items() if n)
    computed = [f"{summary[k]} {label}" for k, label in (
        ("chunk_misses", "in no tier"), ("loads_skipped_by_cost", "skipped by cost"),
        ("loads_timed_out", "timed out"), ("loads_failed", "failed")) if summary[k]]
    faults = [f"{summary[k]} {label}" for k, label in (
        ("writes_dropped", "writes dropped"), ("corrupt", "corrupt chunks"),
        ("probe_errors", "probe errors"), ("unreachable", "workers unreachable")) if summary[k]]
    handoff = summary.get("handoff") or {}
    loaded = "handoff" if handoff.get("pulls") and not any(summary["chunk_hits"].values()) else "tiers"
    return (f"device {100 * summary['device_hit_tokens'] / prompt:.1f}% + {loaded} "
            f"{100 * summary['loaded_tokens'] / prompt:.1f}% of {prompt} prompt tokens"
            + (f"; chunk loads: {hits}" if hits else "")
            + (f"; requests that loaded nothing: {', '.join(computed)}" if computed else "")
            + (f"; {', '.join(faults)}" if faults else "")
            + describe_handoff(handoff))


def describe_handoff(handoff: dict[str, Any]) -> str:
    """"; handoff: N pulls of T tokens, B bytes a token, M ms a pull" for a PD cluster."""
    pulls, tokens = handoff.get("pulls", 0), handoff.get("tokens_received", 0)
    if not pulls or not tokens:
        return ""
    return (f"; handoff: {pulls} pulls of {tokens} tokens, {handoff['bytes_received'] / tokens:,.0f} bytes a "
            f"token ({handoff['bytes_received'] / 2**20:,.1f} MiB), {1000 * handoff['pull_seconds'] / pulls:.0f} ms a pull")
