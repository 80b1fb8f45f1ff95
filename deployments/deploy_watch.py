"""Deploy the app, and fail within a minute, in one line, when a deployment cannot be placed.

Why: `serve.run` waits until every replica runs; a replica the cluster has no room for stays pending
forever, and only the Serve controller's log says so. After 30 s pending, the controller puts the
replica's needs and the cluster's free resources in the deployment's status message; this watch turns
that message into the start-up error, with the flags that change it.

Serve's "free resources" are the whole cluster's sum (`ray.available_resources()`), while a replica is an
actor placed on one node: 3 nodes with 1 CPU free each have 3 free, yet none takes a 2-CPU replica. So the
fit is decided per node, from each node's free resources as the GCS reports them. A replica Serve still
reports pending a while later (PENDING_LIMIT_S) is reported too, whatever the cause: without that, a cause
the watch cannot see (the per-node view unavailable, a node's labels) left the start waiting for ever.

`serve.run` runs in a thread of its own, which a failed or interrupted start leaves inside it; the stop
ends it (`end_deploys`) before it shuts Ray down.
"""

from __future__ import annotations

import ast
import ctypes
import math
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

UNSCHEDULABLE = re.compile(
    r"has (\d+) replicas that have taken more than \S+ to be scheduled.*?"
    r"Resources required for each replica: (\{.*?\}), total resources available: (\{.*?\})",
    re.S,
)
# How long after Serve first reports a replica pending the start gives up on it, even though some node seems to
# have room: replicas that are only slow (worker processes starting on a loaded machine) run well within it
PENDING_LIMIT_S = 300.0
_EPS = 1e-9


class DeploymentUnschedulable(RuntimeError):
    """A deployment's replicas found no node with room for them."""


def _parse(text: str) -> dict[str, float] | None:
    try:
        value = ast.literal_eval(text)
        return {str(k): float(v) for k, v in value.items()}
    except (ValueError, TypeError, AttributeError, SyntaxError):
        return None


def _short_on(need: Mapping[str, float], free: Mapping[str, float]) -> set[str]:
    """The resources of `need` that `free` lacks."""
    return {k for k, v in need.items() if float(free.get(k, 0.0)) + _EPS < v}


def short_resources(need: Mapping[str, float], nodes_free: Sequence[Mapping[str, float]]) -> set[str]:
    """The resources that keep every node in `nodes_free` from taking one replica needing `need`; empty when
    some node can. A resource no node has enough of is short; when each is somewhere but no node has them
    all together, each one some node lacks is."""
    lacks = [_short_on(need, free) for free in nodes_free]
    if not lacks or any(not short for short in lacks):
        return set() if lacks else set(need)
    nowhere = set.intersection(*lacks)
    return nowhere or set.union(*lacks)


def advice(short: set[str]) -> str:
    """The flags and settings that change each short resource (the replicas' count changes them all)."""
    fixes = []
    if "CPU" in short:
        fixes.append("raise --num-cpus (or the cluster's CPUs), lower --replicas or engine.num_cpus")
    if "GPU" in short:
        fixes.append("add nodes with free GPUs, lower --replicas or engine.num_gpus")
    custom = sorted(k for k in short if k not in ("CPU", "GPU"))
    if custom:
        names = ", ".join(custom)
        fixes.append(
            f"start nodes with `ray start --resources` giving {names} (a local cluster has none), lower --replicas "
            f"or engine.resources"
        )
    return "; ".join(fixes) or "`ray status` on the cluster says what it waits for"


def pending_replicas(status: Any, app_name: str) -> list[tuple[str, int, str, str]]:
    """(deployment, replicas, needs per replica, cluster-wide free) for each deployment of `app_name` whose
    replicas Serve reports waiting to be scheduled, as its status message words them."""
    app = getattr(status, "applications", {}).get(app_name)
    found = []
    for name, dep in (getattr(app, "deployments", None) or {}).items():
        m = UNSCHEDULABLE.search(getattr(dep, "message", "") or "")
        if m:
            found.append((name, int(m.group(1)), m.group(2), m.group(3)))
    return found


def unschedulable_reason(
    status: Any, app_name: str, nodes_free: Sequence[Mapping[str, float]] | None = None
) -> str | None:
    """One line naming the first deployment of `app_name` whose replicas no node has room for, or None.

    `nodes_free`: each live node's free resources; without them, the cluster-wide sum of Serve's message
    decides. Serve also reports replicas that waited 30 s only because a loaded machine starts worker
    processes slowly: where a node has room, those are not unschedulable."""
    for name, count, required, available in pending_replicas(status, app_name):
        need, total = _parse(required), _parse(available)
        if need is None:
            short = {"?"}
        elif nodes_free is not None:
            short = short_resources(need, nodes_free)
        else:
            short = _short_on(need, total or {})
        if not short:
            continue
        split = ""
        if nodes_free is not None and need is not None and total is not None and not _short_on(need, total):
            split = f", split across {len(nodes_free)} nodes: no one node has room for a replica"
        return (
            f"deployment {name}: {count} replica(s) cannot be scheduled: each needs {required}, "
            f"the cluster has {available} free{split}; {advice(short - {'?'})}"
        )
    return None


def still_pending_reason(status: Any, app_name: str, waited_s: float) -> str | None:
    """One line naming the first deployment of `app_name` whose replicas Serve still reports waiting to be
    scheduled `waited_s` after it first did, or None."""
    for name, count, required, available in pending_replicas(status, app_name):
        need, total = _parse(required), _parse(available)
        short = _short_on(need, total) if need is not None and total is not None else set()
        return (
            f"deployment {name}: {count} replica(s) still not scheduled {waited_s:.0f}s after Serve reported them "
            f"waiting: each needs {required}, the cluster has {available} free; {advice(short)}"
        )
    return None


def nodes_free_resources() -> list[dict[str, float]] | None:
    """Each live node's free resources, from the GCS (the view `ray status` gives), or None where it cannot
    be had: no Ray connection here, or a Ray without that interface."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        from ray.autoscaler.v2.sdk import get_cluster_status

        cluster = get_cluster_status(ray.get_runtime_context().gcs_address, timeout=10)
        free = [node.available_resources() for node in [*cluster.active_nodes, *cluster.idle_nodes]]
        return free or None  # no node listed: nothing to decide on
    except Exception:
        return None


class DeployEnded(BaseException):
    """Raised inside a deploy thread that `end_deploys` ends."""


_deploys: list[threading.Thread] = []  # deploy threads still inside serve.run
_deploys_lock = threading.Lock()


def deploy_or_explain(app: Any, cfg: dict, poll_s: float = 2.0, pending_polls: int | None = None) -> None:
    """`serve.run` the app; raise DeploymentUnschedulable as soon as Serve reports a replica no node can take,
    or once Serve has reported replicas waiting to be scheduled for `pending_polls` polls in a row (by default
    as many as PENDING_LIMIT_S takes)."""
    from ray import serve

    if pending_polls is None:
        pending_polls = max(1, math.ceil(PENDING_LIMIT_S / poll_s)) if poll_s > 0 else 1
    done = threading.Event()
    failure: list[BaseException] = []

    def deploy() -> None:
        try:
            try:
                serve.run(app, name=cfg["name"], route_prefix=cfg["route_prefix"], blocking=False)
            except DeployEnded:
                raise
            except BaseException as exc:  # handed to the caller's thread
                failure.append(exc)
            finally:
                with _deploys_lock:  # no longer one `end_deploys` may end
                    _deploys.remove(threading.current_thread())
                done.set()
        except DeployEnded:  # ended by `end_deploys`, wherever it landed (the stop that asked goes on)
            pass

    thread = threading.Thread(target=deploy, name="kvmesh-deploy", daemon=True)
    _deploys.append(thread)
    thread.start()
    pending_seen = 0  # polls in a row that found replicas waiting to be scheduled
    while not done.wait(poll_s):
        try:
            status = serve.status()
        except Exception:  # the controller is still starting
            continue
        if not pending_replicas(status, cfg["name"]):
            pending_seen = 0
            continue
        pending_seen += 1
        reason = unschedulable_reason(status, cfg["name"], nodes_free_resources())
        if not reason and pending_seen >= pending_polls:
            reason = still_pending_reason(status, cfg["name"], pending_seen * poll_s)
        if reason:
            raise DeploymentUnschedulable(reason)
    if failure:
        raise failure[0]


def end_deploys(timeout_s: float = 10.0) -> int:
    """End the deploy threads still inside `serve.run` and wait up to `timeout_s` for them; returns how many
    are still running. Call before `ray.shutdown`. Why: `serve.run` goes on polling Serve's controller every
    second, and its first Ray call after the shutdown starts a new Ray cluster itself (`ray.init()` with
    Ray's defaults: not kept on loopback, its files in the shared /tmp/ray) that nothing ever stops. The
    thread gets DeployEnded at its next Python step (CPython's PyThreadState_SetAsyncExc): after its poll,
    or as soon as a Ray call it waits in returns."""
    with _deploys_lock:  # a thread listed here has not left serve.run, so the exception lands in its own code
        ending = list(_deploys)
        for thread in ending:
            if thread.ident is not None and thread.is_alive():
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(DeployEnded))
    for thread in ending:
        thread.join(timeout_s)
    with _deploys_lock:  # one ended before it could take itself off
        _deploys[:] = [t for t in _deploys if t.is_alive()]
    return sum(1 for t in ending if t.is_alive())
