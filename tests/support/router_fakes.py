"""A kvmesh router outside Serve, for unit tests with fake replicas (no Ray cluster, no KV-event streams)."""

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
