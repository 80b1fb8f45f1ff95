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
    assert snap["total"]["hit_rate_requests"] == pytest.approx((0.64 + 0 + 0.64) / 3)  # mean of cached/prompt
    assert snap["total"]["requests_with_hit"] == pytest.approx(2 / 3)
    text = m.prometheus_text(PredictionLedger().snapshot(), {"index": {"lookups": 3}, "decisions": 3})
    assert 'kvmesh_hit_rate_tokens{replica="r1"} 0.32' in text
    assert 'kvmesh_hit_rate_requests{replica="r1"} 0.32' in text  # (0.64 + 0) / 2
    assert 'kvmesh_requests_with_hit{replica="r1"} 0.5' in text
    assert 'kvmesh_ttft_seconds_bucket{replica="r1",le="0.1"} 1' in text
    assert 'kvmesh_http_errors_total{status="400"} 1' in text
    assert "kvmesh_hash_contract_alarm 0" in text and 'kvmesh_router_index_events_total{counter="lookups"} 3' in text


def _per_replica(router: dict, family_name: str) -> dict:
    """The samples of one counter family in the metrics text for these routing stats, by replica."""
    from prometheus_client.parser import text_string_to_metric_families

    text = ServingMetrics().prometheus_text(PredictionLedger().snapshot(), router)
    return {
        s.labels["replica"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == family_name
        for s in family.samples
    }


def test_each_replicas_engine_steps_are_a_counter_and_a_replica_without_them_is_left_out():
    router = {"routing_stats": {"a": {"steps": 40, "queued": 0}, "b": {"steps": 7}, "c": {"queued": 1}}}
    steps = _per_replica(router, "kvmesh_replica_engine_steps")
    assert steps == {"a": 40, "b": 7}  # c reports no step count (an older replica): no sample, not a 0
    assert "kvmesh_replica_engine_steps_total" not in ServingMetrics().prometheus_text(None, {"routing_stats": {}})


# ---------------------------------------------------------------------------- stage timers
def test_stage_timers_accumulate_per_stage_in_snapshot_and_text():
    from prometheus_client.parser import text_string_to_metric_families

    m = ServingMetrics()
    m.record_stage("tokenize", 0.001)
    m.record_stage("tokenize", 0.003)
    m.record_stage("engine_call", 0.010)
    stages = m.snapshot()["stages"]
    assert stages["tokenize"] == {"seconds_total": pytest.approx(0.004), "count": 2}
    assert stages["engine_call"]["count"] == 1
    samples = {
        (s.name, s.labels.get("stage")): s.value
        for family in text_string_to_metric_families(m.prometheus_text())
        for s in family.samples
    }
    assert samples[("kvmesh_ingress_stage_seconds_total", "tokenize")] == pytest.approx(0.004)
    assert samples[("kvmesh_ingress_stage_calls_total", "tokenize")] == 2
    assert samples[("kvmesh_ingress_stage_calls_total", "engine_call")] == 1


def test_ingress_records_call_stages_and_the_engines_share_only_when_reported():
    from types import SimpleNamespace

    from kvmesh.deployments.ingress import Ingress

    fake = SimpleNamespace(serving_metrics=ServingMetrics())
    record = Ingress.func_or_class._record_call_stages
    t0 = 100.0
    record(fake, t0, t0 + 0.002, 0.004)  # a unary call: the engine reported its time to first output
    record(fake, t0, t0 + 0.002, None)  # a stream's first chunk carries no engine time
    stages = fake.serving_metrics.snapshot()["stages"]
    assert stages["pre_call"] == {"seconds_total": pytest.approx(0.004), "count": 2}
    assert stages["engine_call"]["count"] == 2
    assert stages["engine_first_output"] == {"seconds_total": pytest.approx(0.004), "count": 1}


def test_what_each_replica_loaded_through_lmcache_is_a_counter():
    router = {"routing_stats": {"a": {"external_hit_tokens": 704}, "b": {"external_hit_tokens": 0}, "c": {}}}
    assert _per_replica(router, "kvmesh_replica_lmcache_loaded_tokens") == {"a": 704, "b": 0}


def test_a_forgotten_replica_leaves_the_metrics_and_the_totals_keep_it(monkeypatch):
    """Autoscaling creates a new replica id for every replica it adds: a forgotten one's series must go."""
    from kvmesh.deployments import serving_metrics

    clock = [1000.0]
    monkeypatch.setattr(serving_metrics.time, "monotonic", lambda: clock[0])
    m = ServingMetrics()
    for rid in ("r1", "r2", "r3"):
        m.record(rid, 100, 32, 4, 0.05)
    m.forget_replica("r1")
    m.forget_replica("never-seen")  # nothing to drop: no error
    m.record("r1", 100, 64, 4, 0.05)  # a stream that finished on the replica Serve was stopping
    assert set(m.snapshot()["per_replica"]) == {"r2", "r3"}
    assert m.snapshot()["total"]["requests"] == 4 and m.snapshot()["total"]["cached_tokens"] == 160
    text = m.prometheus_text()
    assert 'replica="r1"' not in text and 'kvmesh_requests_total{replica="r2"} 1' in text
    assert "kvmesh_requests_total 4" in text
    clock[0] += serving_metrics.FORGOTTEN_HOLD_S
    m.forget_replica("r2")  # the hold on r1 has passed: an id routed to again counts afresh
    m.record("r1", 100, 0, 4, None)
    assert set(m.snapshot()["per_replica"]) == {"r1", "r3"} and m.snapshot()["per_replica"]["r1"]["requests"] == 1
    assert set(m._forgotten) == {"r2"}  # what it remembers is bounded by the hold, not by the ids ever seen
