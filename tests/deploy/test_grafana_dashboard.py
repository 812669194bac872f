"""deploy/grafana/tandem.json against what a live `tandem serve` and `tandem route` export:
every metric a panel's query names exists, and every label it groups by or prints is one
those metrics carry, so the dashboard cannot drift from the code silently."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.live_server import LiveServer, start_router

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "tandem.json"
SCRAPE_LABELS = {"instance", "job", "le"}  # added by Prometheus at scrape, or the histogram's own


@pytest.fixture(scope="module")
def exported(tandem_server_process: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Family name -> label names seen on its samples, from the server's and a router's
    /metrics after one request through the router."""
    url, process = start_router(tmp_path_factory.mktemp("grafana") / "route.log", "--worker",
                                tandem_server_process.url)
    try:
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert reply.status_code == 200, reply.text
        families: dict[str, set[str]] = {}
        for base in (url, tandem_server_process.url):
            for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=10).text):
                labels = families.setdefault(family.name, set())
                for sample in family.samples:
                    labels.update(sample.labels)
        yield families
    finally:
        process.terminate()
        process.wait(timeout=30)


def _family(name: str, families: dict[str, set[str]]) -> str | None:
    for suffix in ("", "_total", "_bucket", "_count", "_sum"):
        if suffix and not name.endswith(suffix):
            continue
        base = name[: len(name) - len(suffix)] if suffix else name
        if base in families:
            return base
    return None


def test_the_dashboard_is_a_grafana_import() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["__inputs"][0]["name"] == "DS_PROMETHEUS" and board["uid"] and board["title"] == "tandem"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${DS_PROMETHEUS}"


def test_every_query_names_exported_metrics_and_labels(exported: dict[str, set[str]]) -> None:
    board = json.loads(DASHBOARD.read_text())
    targets = [t for panel in board["panels"] for t in panel.get("targets", [])]
    assert len(targets) >= 30
    labels_checked = 0
    for target in targets:
        expr = target["expr"]
        names = re.findall(r"\btandem[:_][A-Za-z0-9_:]+", expr)
        assert names, expr
        families = [_family(name, exported) for name in names]
        assert None not in families, f"not exported: {[n for n, f in zip(names, families, strict=True) if f is None]}"
        grouped = {label.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for label in group.split(",")}
        printed = set(re.findall(r"\{\{(\w+)\}\}", target.get("legendFormat", "")))
        carried = set().union(*(exported[f] for f in families if f is not None))
        if carried:  # a family with no samples yet (no KV tiers here, say) shows no labels
            missing = (grouped | printed) - SCRAPE_LABELS - carried
            assert not missing, f"{expr}: labels {missing} not on {families} (they carry {carried})"
            labels_checked += 1
    assert labels_checked >= 25
