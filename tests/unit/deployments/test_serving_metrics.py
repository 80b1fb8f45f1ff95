"""Serving metrics text (deployments/serving_metrics.py): token- and request-weighted hit rates."""

from __future__ import annotations

import pytest

from kvmesh.deployments.prediction import PredictionLedger
from kvmesh.deployments.serving_metrics import ServingMetrics


# ---------------------------------------------------------------------------- metrics
def test_metrics_text_has_token_and_request_weighted_hit_rates():
    m = ServingMetrics()
    m.record("r1", 100, 64, 4, 0.05)
    m.record("r1", 100, 0, 4, 0.2)
    m.record("r2", 50, 32, 1, None)
    m.record_error(400)
    snap = m.snapshot()
    assert snap["total"]["hit_rate_tokens"] == pytest.approx(96 / 250)
    assert snap["total"]["hit_rate_requests"] == pytest.approx(2 / 3)
    text = m.prometheus_text(PredictionLedger().snapshot(), {"index": {"lookups": 3}, "decisions": 3})
    assert 'kvmesh_hit_rate_tokens{replica="r1"} 0.32' in text
    assert 'kvmesh_ttft_seconds_bucket{replica="r1",le="0.1"} 1' in text
    assert 'kvmesh_http_errors_total{status="400"} 1' in text
    assert "kvmesh_hash_contract_alarm 0" in text and 'kvmesh_router_index_events_total{counter="lookups"} 3' in text
