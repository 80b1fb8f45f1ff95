"""A kvmesh router outside Serve, for unit tests with fake replicas (no Ray cluster, no KV-event streams), and
the engine requests Serve would hand it."""

from __future__ import annotations


def make_router(**kw):
    """A `KvmeshRouter` built as Serve would, its state initialised without subscribing to KV events."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from kvmesh.deployments.router import KvmeshRouter

    r = KvmeshRouter(
        deployment_id=DeploymentID(name="EngineReplica", app_name="t"), handle_source=DeploymentHandleSource.UNKNOWN
    )
    r.initialize_state(subscribe_events=False, **kw)
    return r


def fake_request(ids, request_id, salt=None):
    """A pending engine request as Serve hands it to the router: its prompt's token ids, under `request_id`."""
    from types import SimpleNamespace

    req = {"request_id": request_id, "prompt_token_ids": ids, "cache_salt": salt, "params": {"max_tokens": 4}}
    return SimpleNamespace(args=[req], kwargs={}, metadata=SimpleNamespace(internal_request_id="i-" + request_id))


def ranked_ids(ranked) -> list[str]:
    """The replica ids of a ranking `choose_replicas` returned, best first."""
    return [g[0].replica_id.unique_id for g in ranked]
