"""Each ingress replica's router state, through the HTTP front of an app with several ingress replicas."""

from __future__ import annotations

import time

import httpx


def router_states(url: str, headers: dict, want: int = 2, tries: int = 40) -> dict[str, dict]:
    """/kvmesh/state's router section from each ingress replica, keyed by router id. HAProxy picks a
    replica per connection, so each try opens a connection of its own, until `want` routers answered."""
    seen: dict[str, dict] = {}
    for _ in range(tries):
        with httpx.Client(timeout=30, headers=headers) as fresh:
            router = (fresh.get(url + "/kvmesh/state").json().get("router")) or {}
        rid = (router.get("sync") or {}).get("router")
        if rid:
            seen[rid] = router
        if len(seen) >= want:
            break
        time.sleep(0.25)
    return seen
