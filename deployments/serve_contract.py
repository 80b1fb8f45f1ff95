"""What kvmesh relies on in Ray and Ray Serve, checked before a local Ray starts and when the app is built.

The router uses only Serve's public request-router surface (`ray.serve.request_router`): it ranks in
`choose_replicas`, and learns where Serve placed a request, or that the caller gave up, from the
request's own `PendingRequest.future` (Serve resolves it with the chosen replica, cancels it when the
caller goes away, and gives a retried request a fresh one through `reset_future`). If an installed Ray
changes any of that, placement bookkeeping (policy credit, speculative prefixes, predictions) would
stop without an error, so `check_serve_contract` fails the deploy instead, naming what differs.

The few private Ray names kvmesh uses elsewhere (nodes on loopback, a private Ray folder, the benchmarks'
patient node start, Serve's replica gRPC binding and transport, the drain's in-flight count) are all in
deployments/ray_private.py; its `problems()` is part of this check, so a Ray that lacks one of them fails
the deploy in the same way, naming the symbol.

The ingress's prefix cache reset calls every engine replica through `DeploymentHandle.broadcast` (public,
alpha in Ray 2.60), checked here too.

The supported Ray range here contains the release `pyproject.toml` pins (2.60.0, the one tested).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import typing

SUPPORTED_RAY = ((2, 60), (2, 61))  # [min, max): the ray[serve] releases this router is tested against
_ROUTER_HOOKS = ("choose_replicas", "initialize_state", "on_request_completed", "on_replica_actor_died")


class ServeContractError(RuntimeError):
    """The installed Ray Serve does not behave as kvmesh's router needs."""


def _version(text: str) -> tuple[int, int]:
    parts = text.split(".")
    return int(parts[0]), int(parts[1])


def contract_problems() -> list[str]:
    """Every way the installed Ray Serve differs from what the router needs (empty when it fits)."""
    import ray
    from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

    problems = []
    low, high = SUPPORTED_RAY
    if not low <= _version(ray.__version__) < high:
        problems.append(
            f"ray {ray.__version__} is outside the supported range >={low[0]}.{low[1]},<{high[0]}.{high[1]}"
        )
    for hook in _ROUTER_HOOKS:
        if not callable(getattr(RequestRouter, hook, None)):
            problems.append(f"RequestRouter.{hook} is missing")
    if not isinstance(getattr(RequestRouter, "curr_replicas", None), property):
        problems.append("RequestRouter.curr_replicas is not a property")
    if not isinstance(getattr(RunningReplica, "routing_stats", None), property):
        problems.append("RunningReplica.routing_stats is not a property")
    from ray.serve.handle import DeploymentHandle

    if not callable(getattr(DeploymentHandle, "broadcast", None)):  # the ingress's prefix cache reset
        problems.append("DeploymentHandle.broadcast is missing")
    fields = {f.name for f in dataclasses.fields(PendingRequest)} if dataclasses.is_dataclass(PendingRequest) else set()
    for name in ("args", "metadata", "future"):
        if name not in fields:
            problems.append(f"PendingRequest has no field {name!r}")
    if not callable(getattr(PendingRequest, "reset_future", None)):
        problems.append("PendingRequest.reset_future is missing")
    if not problems:
        problems += _pending_request_behaviour(PendingRequest)
    from kvmesh.deployments import ray_private

    return problems + ray_private.problems()


def _pending_request_behaviour(pending_request_cls) -> list[str]:
    """A PendingRequest made as Serve makes one: its future must be an asyncio future of the loop it
    was made on, a fresh one after reset_future, and its metadata must carry internal_request_id."""
    metadata_cls: typing.Any = typing.get_type_hints(pending_request_cls).get("metadata")
    if not dataclasses.is_dataclass(metadata_cls) or "internal_request_id" not in {
        f.name for f in dataclasses.fields(metadata_cls)
    }:
        return ["PendingRequest.metadata has no internal_request_id"]
    make_metadata: typing.Callable[..., typing.Any] = typing.cast(typing.Any, metadata_cls)

    async def probe() -> list[str]:
        metadata = make_metadata(request_id="kvmesh-check", internal_request_id="kvmesh-check")
        pr = pending_request_cls(args=[{}], kwargs={}, metadata=metadata)
        first = pr.future
        out = []
        if not isinstance(first, asyncio.Future) or first.get_loop() is not asyncio.get_running_loop():
            out.append("PendingRequest.future is not an asyncio future of the routing loop")
        pr.reset_future()
        if pr.future is first:
            out.append("PendingRequest.reset_future does not give the request a new future")
        return out

    try:  # on a thread of its own: the caller may be running an event loop (Serve's router, a replica)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, probe()).result()
    except TypeError as exc:  # the metadata or request constructor changed
        return [f"PendingRequest cannot be made as Serve makes it: {exc}"]


_checked = False  # the installed Ray does not change within a process: check it once


def check_serve_contract() -> None:
    """Raise ServeContractError, naming every difference, when the installed Ray Serve does not fit."""
    global _checked
    if _checked:
        return
    problems = contract_problems()
    _checked = not problems
    if problems:
        raise ServeContractError(
            "kvmesh does not support the installed Ray Serve: "
            + "; ".join(problems)
            + " (install the ray[serve] version pyproject.toml pins)"
        )
