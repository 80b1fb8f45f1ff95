"""EngineReplica's own bookkeeping around the engine, with kvmesh's driver interface faked (no vLLM)."""

from __future__ import annotations

import errno
import logging
import socket
from types import SimpleNamespace

import pytest

from kvmesh.deployments import engine_driver
from kvmesh.deployments.engine import EngineReplica
from kvmesh.deployments.failure_metrics import FailureCounters, failure_metrics_text


class _FakeDriver:
    def __init__(self):
        self.load = SimpleNamespace(queued=0, running=0, aborted=0)
        self.broken_internals = False

    def num_blocks(self) -> int:
        return 64

    def kv_usage(self) -> float:
        if self.broken_internals:
            raise AttributeError("'InprocClient' object has no attribute 'engine_core'")
        return 0.25

    def healthy(self) -> bool:
        return True


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _replica(monkeypatch, tmp_path, on_build=None) -> EngineReplica:
    """A replica whose driver is fake; `on_build(kv_events)` runs where vLLM would bind its publisher."""

    def build_engine_args(cfg, model_path, kv_events, kv_transfer):
        return kv_events

    def make_driver(mode, kv_events, **_):
        if on_build is not None:
            on_build(kv_events)
        return _FakeDriver()

    monkeypatch.setattr(engine_driver, "build_engine_args", build_engine_args)
    monkeypatch.setattr(engine_driver, "make_driver", make_driver)
    return EngineReplica({"model": str(tmp_path)})


def test_event_ports_are_held_until_the_engine_binds_them(monkeypatch, tmp_path):
    """Another replica starting at the same moment must not be able to take this replica's KV-event
    ports between choosing them and vLLM binding them; vLLM's own (ZMQ) bind must still succeed."""
    import zmq

    seen = {}

    def on_build(kv_events):
        ports = [_port(kv_events["endpoint"]), _port(kv_events["replay_endpoint"])]
        for port in ports:
            other = socket.socket()
            try:
                with pytest.raises(OSError) as info:
                    other.bind(("", port))
                assert info.value.errno == errno.EADDRINUSE
            finally:
                other.close()
        ctx = zmq.Context.instance()
        pub, replay = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
        try:
            pub.bind(kv_events["endpoint"])  # tcp://*:port, as vLLM's publisher binds it
            replay.bind(kv_events["replay_endpoint"])
        finally:
            pub.close(linger=0)
            replay.close(linger=0)
        seen["ports"] = ports

    r = _replica(monkeypatch, tmp_path, on_build)
    assert len(set(seen["ports"])) == 2
    assert r.kv_events_endpoint.endswith(f":{seen['ports'][0]}")


def test_routing_stats_survive_a_failing_read_of_engine_internals(monkeypatch, tmp_path, caplog):
    """If vLLM's internals change shape, the replica still publishes its KV-event endpoint and load
    (routing keeps its prefix view), counts the failure for /metrics, logs it, and tries again."""
    r = _replica(monkeypatch, tmp_path)
    assert r.record_routing_stats()["kv_usage"] == 0.25
    r.driver.broken_internals = True
    with caplog.at_level(logging.ERROR, logger="ray.serve.kvmesh"):
        stats = r.record_routing_stats()
    assert "cannot read its KV usage" in caplog.text
    assert stats["kv_events_endpoint"] == r.kv_events_endpoint and stats["replay_endpoint"] == r.replay_endpoint
    assert stats["stats_errors"] == 1 and stats["kv_usage"] == 0.0
    assert r.record_routing_stats()["stats_errors"] == 2  # retried on every report
    text = failure_metrics_text(FailureCounters(), {"routing_stats": {r.replica_id: r.record_routing_stats()}})
    assert f'kvmesh_replica_stats_errors_total{{replica="{r.replica_id}"}} 3' in text
    r.driver.broken_internals = False
    assert r.record_routing_stats()["kv_usage"] == 0.25
