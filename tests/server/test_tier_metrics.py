"""The KV tiers' gauges and counters as /metrics renders them, from a /load report's numbers."""

from __future__ import annotations

from tandem.server.metrics import _tier_metrics


def test_the_bytes_a_token_takes_in_the_tiers_are_a_gauge_labelled_with_the_codec() -> None:
    families = {f.name: f for f in _tier_metrics("smollm2", {
        "codec": "int8", "bytes_per_token": 12240.0,
        "media": {"cpu": {"blocks": 4, "bytes_in": 100.0}},
    })}
    per_token = families["tandem:kv_tier_bytes_per_token"]
    assert per_token.type == "gauge"
    assert [(s.labels, s.value) for s in per_token.samples] == [
        ({"model_name": "smollm2", "codec": "int8"}, 12240.0)]
    bytes_in = families["tandem:kv_tier_bytes_in"]
    assert [(s.labels["medium"], s.value) for s in bytes_in.samples if s.name.endswith("_total")] == [("cpu", 100.0)]
