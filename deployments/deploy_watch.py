"""Deploy the app, and fail within a minute, in one line, when a deployment cannot be placed.

Why: `serve.run` waits until every replica runs; a replica the cluster has no room for stays pending
forever, and only the Serve controller's log says so. After 30 s pending, the controller puts the
replica's needs and the cluster's free resources in the deployment's status message; this watch turns
that message into the start-up error, with the flags that change it.

`serve.run` runs in a thread of its own, which a failed or interrupted start leaves inside it; the stop
ends it (`end_deploys`) before it shuts Ray down.
"""

from __future__ import annotations

import ast
import ctypes
import re
import threading
from typing import Any

UNSCHEDULABLE = re.compile(
    r"has (\d+) replicas that have taken more than \S+ to be scheduled.*?"
    r"Resources required for each replica: (\{.*?\}), total resources available: (\{.*?\})",
    re.S,
)
FIX = "raise --num-cpus (or the cluster's CPUs), lower --replicas or engine.num_cpus"


class DeploymentUnschedulable(RuntimeError):
    """A deployment's replicas found no node with room for them."""


def _fits(required: str, available: str) -> bool:
    """Whether the cluster's free resources cover one replica. Serve also reports replicas that waited
    30 s only because a loaded machine starts worker processes slowly: those are not unschedulable."""
    try:
        need, free = ast.literal_eval(required), ast.literal_eval(available)
        return all(float(free.get(k, 0.0)) >= float(v) for k, v in need.items())
    except (ValueError, TypeError, AttributeError, SyntaxError):
        return False


def unschedulable_reason(status: Any, app_name: str) -> str | None:
    """One line naming the first deployment of `app_name` whose replicas wait for resources, or None."""
    app = getattr(status, "applications", {}).get(app_name)
    for name, dep in (getattr(app, "deployments", None) or {}).items():
        m = UNSCHEDULABLE.search(getattr(dep, "message", "") or "")
        if m and not _fits(m.group(2), m.group(3)):
            return (
                f"deployment {name}: {m.group(1)} replica(s) cannot be scheduled: each needs {m.group(2)}, "
                f"the cluster has {m.group(3)} free; {FIX}"
            )
    return None


class DeployEnded(BaseException):
    """Raised inside a deploy thread that `end_deploys` ends."""


_deploys: list[threading.Thread] = []  # deploy threads still inside serve.run
_deploys_lock = threading.Lock()


def deploy_or_explain(app: Any, cfg: dict, poll_s: float = 2.0) -> None:
    """`serve.run` the app; raise DeploymentUnschedulable as soon as Serve reports a replica it cannot place."""
    from ray import serve

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
    while not done.wait(poll_s):
        try:
            reason = unschedulable_reason(serve.status(), cfg["name"])
        except Exception:  # the controller is still starting
            reason = None
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
