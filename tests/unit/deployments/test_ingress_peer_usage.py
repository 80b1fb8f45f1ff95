"""The ingress's view of the peers' tenant usage passes admission's per-tenant window on to the router's log,
also when the router is made after the tenant's first request."""

from types import SimpleNamespace

from kvmesh.deployments import ingress, local_state
from kvmesh.deployments.tenant_usage import WINDOW_S, PeerTenantUsage


def test_a_slow_tenants_window_reaches_the_routers_log_made_before_or_after_it_was_asked(monkeypatch):
    log = PeerTenantUsage()
    monkeypatch.setattr(local_state, "ROUTERS", [])
    usage = ingress._PeerTenantUsage()
    usage.keep("slow", 1000.0)  # no router yet: remembered
    assert usage.since("slow", 0) == (0, [])
    monkeypatch.setattr(local_state, "ROUTERS", [SimpleNamespace(peers=SimpleNamespace(tenants=log))])
    usage.since("slow", 0)  # the router exists now: its log keeps the tenant's placements that long
    assert log.window("slow") == 1000.0 and log.window("other") == WINDOW_S
    usage.keep("slower", 5000.0)
    assert log.window("slower") == 5000.0
