"""/kvmesh/state while a node is frozen: the ingress's tier report asks every node's LMCache server actor for
its health, and one on a frozen node never answers. It is waited on once, briefly; after that it is reported
unreachable at once until it answers the call it left open (fake actors and a fake `ray.get`, no Ray)."""

from __future__ import annotations

import time

import pytest
import ray
from ray.exceptions import GetTimeoutError

from kvmesh.kvstore import node_server


class _Ref:
    def __init__(self, server: _Server, value: dict):
        self.server = server
        self.value = value


class _Method:
    def __init__(self, server: _Server, value: dict):
        self.server, self.value = server, value

    def remote(self) -> _Ref:
        self.server.calls += 1
        return _Ref(self.server, self.value)


class _Server:
    """A node server actor: its calls are answered unless its node is `frozen`."""

    def __init__(self) -> None:
        self.frozen = False
        self.calls = 0
        self.health = _Method(self, {"healthy": True})
        self.tier_metrics = _Method(self, {"host_hit_tokens": 1})


@pytest.fixture
def servers(monkeypatch):
    found = {"nodeA": _Server(), "nodeB": _Server()}

    def get(refs, timeout=None):
        if any(r.server.frozen for r in refs):
            time.sleep(timeout or 0)
            raise GetTimeoutError("timed out")
        return [r.value for r in refs]

    def wait(refs, num_returns=1, timeout=None):
        ready = [r for r in refs if not r.server.frozen]
        return ready, [r for r in refs if r.server.frozen]

    monkeypatch.setattr(node_server, "node_servers", lambda: dict(found))
    monkeypatch.setattr(node_server, "_UNANSWERED", {}, raising=False)
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "wait", wait)
    return found


def test_a_frozen_node_server_is_waited_on_once_then_reported_at_once(servers):
    servers["nodeB"].frozen = True
    t0 = time.monotonic()
    first = node_server.tier_status(timeout_s=0.3)
    assert time.monotonic() - t0 >= 0.3  # the first call waits for it, once
    assert first["nodeA"]["health"]["healthy"] and not first["nodeB"]["health"]["healthy"]
    asked = servers["nodeB"].calls
    for _ in range(3):
        t0 = time.monotonic()
        again = node_server.tier_status(timeout_s=0.3)
        assert time.monotonic() - t0 < 0.15  # not waited on again while it has not answered
        assert not again["nodeB"]["health"]["healthy"] and again["nodeA"]["tiers"] == {"host_hit_tokens": 1}
    assert servers["nodeB"].calls == asked  # nor asked again
    assert list(again) == ["nodeA", "nodeB"]
    servers["nodeB"].frozen = False  # it resumes and answers what it was asked: asked afresh
    back = node_server.tier_status(timeout_s=0.3)
    assert back["nodeB"]["health"]["healthy"] and servers["nodeB"].calls > asked


def test_the_state_endpoint_waits_less_for_node_servers_than_metrics_scrapes(monkeypatch):
    from kvmesh.deployments import ingress

    waits = []

    def status(timeout_s=5.0):
        waits.append(timeout_s)
        return {"nodeA": {"health": {"healthy": True}, "tiers": {}}}

    monkeypatch.setattr(node_server, "tier_status", status)
    assert ingress._tier_report()["healthy_nodes"] == 1
    assert waits and waits[0] <= 3.0
