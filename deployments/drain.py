"""Let requests in flight finish before a local app is shut down.

Why: `serve.shutdown()` stops every deployment at once, each within its graceful-shutdown timeout (5 s for
engines), and takes the HTTP front down with them, so streams still running when `kvmesh serve` got SIGTERM
were cut. Before shutting down, `drain` waits until no replica of the app has a request in flight (or a
bound passes). New requests are still admitted meanwhile: a replay that keeps sending is stopped by the
bound, not by the drain.

Serve 2.60 has no public count of a replica's requests in flight; its replica actors (named with Serve's
replica prefix and `<app>#...`) answer `get_num_ongoing_requests`, which is what Serve's own draining
reads. Both are private Serve names (deployments/ray_private.py, checked at deploy). If they change, the
drain logs it and returns at once (the stop is then as abrupt as before, never stuck).
"""

from __future__ import annotations

import logging
import time

from kvmesh.deployments.ray_private import REPLICA_IN_FLIGHT_METHOD, SERVE_REPLICA_ACTOR_PREFIX

log = logging.getLogger(__name__)

REPLICA_PREFIX = SERVE_REPLICA_ACTOR_PREFIX
DRAIN_TIMEOUT_S = 60.0


def in_flight(app_name: str) -> int | None:
    """Requests in flight over every replica of `app_name`, or None when they cannot be counted."""
    import ray

    try:
        names = [
            (a["name"], a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"{REPLICA_PREFIX}{app_name}#")
        ]
        counts: list[int] = ray.get(
            [getattr(ray.get_actor(n, namespace=ns), REPLICA_IN_FLIGHT_METHOD).remote() for n, ns in names],
            timeout=10,
        )
    except Exception as exc:
        log.warning("cannot count requests in flight (%s): stopping without draining", exc)
        return None
    return int(sum(counts))


def drain(app_name: str, timeout_s: float = DRAIN_TIMEOUT_S, poll_s: float = 0.5) -> int:
    """Wait until `app_name` has no request in flight or `timeout_s` passed; return how many are left."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = in_flight(app_name)
        if not left:
            return 0
        if time.monotonic() >= deadline:
            log.warning("%d request(s) still in flight after %.0f s: stopping anyway", left, timeout_s)
            return left
        time.sleep(poll_s)
