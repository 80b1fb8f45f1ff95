"""A second kvmesh app beside the session's `live_app`: same Ray cluster, HTTP port and tenants, its own
route prefix and engines, deleted afterwards. For tests that need their own replica count or engine
settings (or kill replicas) without starting another Ray cluster."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import httpx


@contextlib.contextmanager
def side_app(live_app, name: str, route_prefix: str, config: dict, timeout_s: float = 300.0) -> Iterator[str]:
    """Deploy `config` (plus the session app's port and tenants) as app `name` under `route_prefix`;
    yields its URL once the HTTP front answers /health there and its router can route to every engine
    replica the app starts with (as `start_local` waits)."""
    from ray import serve

    from kvmesh.deployments.app import build_app, initial_engine_replicas, kill_router_registry
    from kvmesh.deployments.config import app_config
    from kvmesh.deployments.deploy_watch import deploy_or_explain

    full = {
        "name": name,
        "route_prefix": route_prefix,
        "port": live_app.config["port"],
        "tenants_file": live_app.config["tenants_file"],
        "routing_stats_period_s": 0.5,
        **config,
    }
    url = live_app.url + route_prefix
    try:
        # as `kvmesh serve` deploys: a replica the test cluster has no room for fails the test within a
        # minute, naming what it needs, instead of serve.run waiting until the test's timeout
        deploy_or_explain(build_app(full), full)
        with httpx.Client(base_url=url, headers=live_app.headers, timeout=60) as c:
            deadline = time.monotonic() + timeout_s
            want = initial_engine_replicas(app_config(full))
            while True:  # the HTTP front learns the route a moment later; the router, each engine's stats
                r = c.get("/health")
                if r.status_code == 200 and ((r.json().get("engines") or {}).get("ready") or 0) >= want:
                    break
                assert time.monotonic() < deadline, f"{name} never became ready: {r.status_code} {r.text[:200]}"
                time.sleep(0.2)
        yield url
    finally:
        serve.delete(name)
        kill_router_registry(name)  # a detached actor: deleting the app leaves it for the session
