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
    text = m.prometheus_text(PredictionLedger().snapshot(), {"index": {"lookups": 3}, "decisions": 3, "rerankings": 7})
    assert "kvmesh_router_decisions_total 3" in text and "kvmesh_router_rerankings_total 7" in text
    assert 'kvmesh_replica_hit_rate_tokens{replica="r1"} 0.32' in text
    assert 'kvmesh_replica_hit_rate_requests{replica="r1"} 0.32' in text  # (0.64 + 0) / 2
    assert 'kvmesh_replica_requests_with_hit{replica="r1"} 0.5' in text
    assert 'kvmesh_replica_ttft_seconds_bucket{replica="r1",le="0.1"} 1' in text
    assert "kvmesh_hit_rate_tokens 0.384" in text and 'kvmesh_ttft_seconds_bucket{le="0.1"} 1' in text
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
        m.record(rid, 100, 32, 4, 0.05, started=clock[0])
    sent = clock[0]
    clock[0] += 1
    m.forget_replica("r1")
    m.forget_replica("never-seen")  # nothing to drop: no error
    m.record("r1", 100, 64, 4, 0.05, started=sent)  # a stream that finished on the replica Serve was stopping
    assert set(m.snapshot()["per_replica"]) == {"r2", "r3"}
    assert m.snapshot()["total"]["requests"] == 4 and m.snapshot()["total"]["cached_tokens"] == 160
    text = m.prometheus_text()
    assert 'replica="r1"' not in text and 'kvmesh_replica_requests_total{replica="r2"} 1' in text
    assert "kvmesh_requests_total 4" in text
    clock[0] += 1
    m.record("r1", 100, 0, 4, None, started=clock[0])  # an id routed to again after it was forgotten counts afresh
    assert set(m.snapshot()["per_replica"]) == {"r1", "r2", "r3"} and m.snapshot()["per_replica"]["r1"]["requests"] == 1


def test_a_request_in_flight_when_its_replica_was_forgotten_never_brings_its_row_back(monkeypatch):
    """However late it finishes (a migrated stream can run for minutes): an hour later the forgotten replica
    has no series, and the totals hold the request, as the prediction ledger does for its in-flight ones."""
    from kvmesh.deployments import serving_metrics

    clock = [1000.0]
    monkeypatch.setattr(serving_metrics.time, "monotonic", lambda: clock[0])
    m = ServingMetrics()
    sent = clock[0]
    m.record("dead-r1", 100, 64, 5, 0.1)
    clock[0] += 1
    m.forget_replica("dead-r1")
    clock[0] += 3600
    m.record("dead-r1", 100, 64, 4000, 0.1)  # when it was sent is not known: the totals only
    assert m.per_replica == {} and m.snapshot()["total"]["requests"] == 2
    m.record("dead-r1", 100, 64, 4000, 0.1, started=sent)
    assert m.per_replica == {} and m.snapshot()["total"]["requests"] == 3
    assert 'replica="dead-r1"' not in m.prometheus_text()


def test_an_answer_no_one_replica_made_counts_in_the_totals_only():
    m = ServingMetrics()
    m.record(None, 100, 64, 40, 0.1)
    assert m.per_replica == {} and m.snapshot()["total"]["completion_tokens"] == 40


def test_forgotten_replicas_are_remembered_up_to_a_bound(monkeypatch):
    from kvmesh.deployments import serving_metrics

    monkeypatch.setattr(serving_metrics, "FORGOTTEN_MAX", 3)
    m = ServingMetrics()
    for rid in ("a", "b", "c", "d", "b"):
        m.forget_replica(rid)
    assert list(m._forgotten) == ["c", "d", "b"]  # the oldest dropped first; forgetting again renews


def _families(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def test_a_sum_over_any_family_is_the_fleet_figure_not_twice_it():
    """Fleet totals and per-replica rows live in separate families: `sum(kvmesh_requests_total)` is the
    requests served, and `sum(kvmesh_replica_requests_total)` the same when no replica was forgotten."""
    from kvmesh.deployments.prediction import PredictionLedger

    m = ServingMetrics()
    m.record("r1", 100, 64, 4, 0.05)
    m.record("r2", 50, 0, 1, 0.2)
    ledger = PredictionLedger()
    ledger.predict("q1", "r1", 64, 16)
    ledger.deliver("q1", 64)
    fams = _families(m.prometheus_text(ledger.snapshot(), {"index": {"blocks": 3}}))
    for name, family in fams.items():
        labelled = {"replica" in s.labels for s in family.samples}
        assert labelled != {True, False}, f"{name} mixes fleet totals and per-replica rows"
    assert sum(s.value for s in fams["kvmesh_requests"].samples) == 2
    assert sum(s.value for s in fams["kvmesh_replica_requests"].samples) == 2
    assert sum(s.value for s in fams["kvmesh_completion_tokens"].samples) == 5
    assert sum(s.value for s in fams["kvmesh_predicted_cached_tokens"].samples) == 64
    assert {s.labels["replica"]: s.value for s in fams["kvmesh_replica_predicted_cached_tokens"].samples} == {"r1": 64}
    ttft = {s.name: s.value for s in fams["kvmesh_ttft_seconds"].samples if "le" not in s.labels}
    assert ttft["kvmesh_ttft_seconds_count"] == 2
    assert fams["kvmesh_replica_ttft_seconds"].type == "histogram"


def test_the_index_levels_are_gauges_and_its_counters_only_count():
    """blocks, replicas and replicas_stale_now go down when replicas leave: in a counter family that reads
    as a reset."""
    from kvmesh.cluster.index import PrefixIndex

    idx = PrefixIndex(max_blocks=1000)
    idx.add_replica("r1")
    idx.add_replica("r2")
    idx.store("r1", range(100))
    idx.store("r2", range(100, 300))
    idx.remove_replica("r2")
    fams = _families(ServingMetrics().prometheus_text(None, {"index": dict(idx.stats)}))
    events = {s.labels["counter"] for s in fams["kvmesh_router_index_events"].samples}
    assert events and not events & {"blocks", "replicas", "replicas_stale_now"}
    assert fams["kvmesh_router_index_events"].type == "counter"
    for name, value in (
        ("kvmesh_router_index_blocks", 100),
        ("kvmesh_router_index_replicas", 1),
        ("kvmesh_router_index_stale_replicas", 0),
    ):
        assert fams[name].type == "gauge" and [s.value for s in fams[name].samples] == [value], name
