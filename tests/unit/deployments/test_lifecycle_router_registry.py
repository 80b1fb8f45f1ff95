"""The routers' registry (a detached actor, deployments/router_sync.py) ends with the app: stopping the app
kills it by name, on a cluster kvmesh joined as on its own, and an app without one stops as before. Ray is
faked: nothing starts."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.deployments import app


class _Actor:
    def __init__(self, name: str):
        self.name = name


@pytest.fixture
def cluster(monkeypatch):
    """A joined cluster running app "kvmesh": the detached actors it holds by (namespace, name), and what
    was killed."""
    import ray
    from ray import serve

    from kvmesh.kvstore import node_server

    actors = {("kvmesh", "router-registry-kvmesh"): _Actor("router-registry-kvmesh")}
    killed: list[tuple[str, bool]] = []

    def get_actor(name, namespace=None):
        if (namespace, name) not in actors:
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return actors[(namespace, name)]

    def kill(actor, no_restart=True):
        killed.append((actor.name, no_restart))
        actors.pop(("kvmesh", actor.name), None)

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(ray, "kill", kill)
    monkeypatch.setattr(serve, "delete", lambda name: None)
    monkeypatch.setattr(serve, "shutdown", lambda: None)
    monkeypatch.setattr(node_server, "stop_node_servers", lambda: 0)
    monkeypatch.setattr(app, "_joined", [True])
    monkeypatch.setattr(app, "_app_name", "kvmesh")
    return actors, killed


def test_stopping_the_app_kills_its_router_registry(cluster):
    actors, killed = cluster
    app.stop_serving()
    assert killed == [("router-registry-kvmesh", True)] and not actors


def test_an_app_without_a_registry_stops_all_the_same(cluster):
    actors, killed = cluster
    actors.clear()
    app.stop_serving()
    assert killed == [] and app._app_name is None


def test_the_registry_killed_is_the_one_the_routers_make(monkeypatch):
    """The name and namespace the stop looks up are those RouterSync gives the registry it makes."""
    from kvmesh.deployments import router_sync

    made = {}

    class Heartbeat:
        async def remote(self, *args):
            raise asyncio.CancelledError  # the router stops: enough has been seen

    class Registry:
        """The registry as discovery uses it: `options(...).remote()` makes it, `heartbeat.remote()` calls it."""

        heartbeat = Heartbeat()

        def options(self, **kw):
            made.update(kw)
            return self

        def remote(self):
            return self

    monkeypatch.setattr(router_sync, "_registry_class", Registry)
    sync = router_sync.RouterSync("kvmesh", placements=None)
    sync.endpoint = "tcp://127.0.0.1:1"
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(sync._discover())
    assert made["name"] == router_sync.REGISTRY_NAME.format(app="kvmesh")
    assert made["namespace"] == router_sync.REGISTRY_NAMESPACE and made["lifetime"] == "detached"
