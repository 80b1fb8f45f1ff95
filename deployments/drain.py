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

Each replica is counted on its own: with autoscaling, a replica still waiting for resources never
answers and one being stopped raises, and neither says anything about the others' streams. A replica
that does not answer is logged once and not asked again during that drain; the drain keeps waiting on
the replicas that answered. Serve's status says how many of the app's replicas are still starting (waiting
for resources, or in their constructor): they hold no request, so a poll waits for the others' answers only,
not the whole count timeout for theirs.
"""

from __future__ import annotations

import logging
import time

from kvmesh.deployments.ray_private import REPLICA_IN_FLIGHT_METHOD, SERVE_REPLICA_ACTOR_PREFIX

log = logging.getLogger(__name__)

REPLICA_PREFIX = SERVE_REPLICA_ACTOR_PREFIX
DRAIN_TIMEOUT_S = 60.0
COUNT_TIMEOUT_S = 10.0  # how long one poll waits for the replicas' answers


def in_flight(app_name: str, timeout_s: float = COUNT_TIMEOUT_S, skip: set[str] | None = None) -> int | None:
    """Requests in flight over the replicas of `app_name` that answered within `timeout_s`; None when the
    replicas cannot be listed, or none of those listed could be counted.

    `skip`: replica names not to ask (those that failed before); names that fail now are added to it and
    logged, so a caller that polls with one set logs each once."""
    import ray

    skip = set() if skip is None else skip
    try:
        names = [
            (a["name"], a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"{REPLICA_PREFIX}{app_name}#")
        ]
    except Exception as exc:
        log.warning("cannot list the replicas to count requests in flight (%s): stopping without draining", exc)
        return None
    if not names:
        return 0
    asked = [(name, ns) for name, ns in names if name not in skip]

    def _skip(name: str, why: object) -> None:
        skip.add(name)
        log.warning("replica %s not counted while draining (%s): waiting on the others", name, why)

    refs: dict = {}  # ObjectRef -> replica name
    for name, ns in asked:
        try:
            refs[getattr(ray.get_actor(name, namespace=ns), REPLICA_IN_FLIGHT_METHOD).remote()] = name
        except Exception as exc:  # stopped between the listing and the call, or Serve renamed the method
            _skip(name, exc)
    unanswered: object = f"no answer within {timeout_s:g} s"  # still waiting for resources, or hung
    # as many answers as replicas not starting (those answer only once started, and hold nothing)
    awaited = max(1, len(refs) - starting_replicas(app_name)) if refs else 0
    try:
        ready, _ = ray.wait(list(refs), num_returns=awaited, timeout=timeout_s) if refs else ([], [])
        timed_out = len(ready) < awaited
        if refs and len(ready) < len(refs):  # any other answer already in
            ready = ray.wait(list(refs), num_returns=len(refs), timeout=0)[0]
    except Exception as exc:
        ready, unanswered, timed_out = [], exc, True
    total, counted = 0, 0
    for ref in ready:
        try:
            total += int(ray.get(ref, timeout=timeout_s))
            counted += 1
        except Exception as exc:  # the replica died before it answered
            _skip(refs[ref], exc)
    answered = set(ready)
    for ref, name in refs.items():
        if ref not in answered and timed_out:  # not when only the starting ones are left: asked again next poll
            _skip(name, unanswered)
    if not counted:
        log.warning("no replica of %s could be counted: stopping without draining", app_name)
        return None
    return total


def starting_replicas(app_name: str) -> int:
    """How many replicas of `app_name` Serve reports starting (0 when its status cannot be had)."""
    import ray
    from ray import serve

    if not ray.is_initialized():  # serve.status() would start a Ray of its own
        return 0
    try:
        app = serve.status().applications.get(app_name)
        deployments = app.deployments.values() if app is not None else ()
        states = [dep.replica_states for dep in deployments]
        return sum(int(count) for by_state in states for state, count in by_state.items() if state == "STARTING")
    except Exception:  # no controller to ask: every replica is waited for, as before
        return 0


def drain(app_name: str, timeout_s: float = DRAIN_TIMEOUT_S, poll_s: float = 0.5) -> int:
    """Wait until `app_name` has no request in flight or `timeout_s` passed; return how many are left."""
    deadline = time.monotonic() + timeout_s
    skip: set[str] = set()
    while True:
        wait_s = min(COUNT_TIMEOUT_S, max(0.1, deadline - time.monotonic()))
        left = in_flight(app_name, timeout_s=wait_s, skip=skip)
        if not left:
            return 0
        if time.monotonic() >= deadline:
            log.warning("%d request(s) still in flight after %.0f s: stopping anyway", left, timeout_s)
            return left
        time.sleep(poll_s)
