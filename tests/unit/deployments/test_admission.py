"""How per-tenant limits combine across ingress replicas: each replica keeps its own buckets and counts,
so R ingress replicas admit up to R x a tenant's limit fleet-wide (docs/scale.md)."""

from __future__ import annotations

import pytest

from kvmesh.deployments.admission import Admission, RateLimited
from kvmesh.deployments.tenants import Limits, Tenant


def _tenant(**limits) -> Tenant:
    return Tenant(id="acme", group=None, salt="s" * 64, limits=Limits(**limits))


@pytest.mark.parametrize("ingress_replicas", [1, 2, 4])
def test_concurrency_limits_add_up_over_ingress_replicas(ingress_replicas):
    tenant = _tenant(max_concurrent=3)
    fronts = [Admission() for _ in range(ingress_replicas)]
    admitted = 0
    for adm in fronts:  # a front that spreads connections evenly: each replica sees its share
        for _ in range(5):
            try:
                adm.try_acquire(tenant, 10)
                admitted += 1
            except RateLimited:
                pass
    assert admitted == 3 * ingress_replicas


@pytest.mark.parametrize("ingress_replicas", [1, 3])
def test_request_rate_limits_add_up_over_ingress_replicas(ingress_replicas):
    now = [0.0]
    tenant = _tenant(requests_per_s=2, burst_requests=2)
    fronts = [Admission(clock=lambda: now[0]) for _ in range(ingress_replicas)]
    admitted = 0
    for adm in fronts:
        for _ in range(10):
            try:
                adm.try_acquire(tenant, 10)
                admitted += 1
            except RateLimited:
                pass
    assert admitted == 2 * ingress_replicas
