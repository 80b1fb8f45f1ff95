"""The router's tier watch (kvstore/node_server.watch_tier_health) over fake node-server handles: a node
whose LMCache server is dead, unreachable or gone leaves the router's tier view in one round."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvmesh.cluster.index import PrefixIndex
from kvmesh.cluster.tier_tracker import TierTracker
from kvmesh.kvstore import node_server


class _Method:
    def __init__(self, reply):
        self.reply = reply

    def remote(self):
        async def call():
            if isinstance(self.reply, Exception):
                raise self.reply
            return self.reply

        return call()


def _actor(reply) -> SimpleNamespace:
    return SimpleNamespace(health=_Method(reply))


def _healthy(serving: bool = True) -> dict:
    return {"serving": serving, "shared_tier_up": True, "restarts": 0}


def test_dead_unreachable_and_vanished_node_servers_leave_the_tier_view(monkeypatch):
    index = PrefixIndex()
    tracker = TierTracker(index)
    for node in ("up", "dead", "unreachable", "gone"):
        index.add_replica(f"r-{node}", node_id=node)
        tracker.set_node(node, has_shared_tier=True, host_capacity_blocks=100)
        tracker.record_prefill(f"r-{node}", [hash(node) + k for k in range(4)])
    actors = {
        "up": _actor(_healthy()),
        "dead": _actor(_healthy(serving=False)),  # the server process was killed; the actor answers
        "unreachable": _actor(RuntimeError("actor died with its node")),
    }  # "gone": no actor any more (its node left the cluster)
    monkeypatch.setattr(node_server, "node_servers", lambda: actors)
    stop = asyncio.Event()

    async def one_round():
        watch = asyncio.create_task(node_server.watch_tier_health(tracker, interval_s=0.01, stop=stop))
        await asyncio.sleep(0.2)
        stop.set()
        await watch

    asyncio.run(one_round())
    assert set(tracker.nodes()) == {"up"}
    assert tracker.counters["nodes_dropped"] == 3
    # the dropped nodes' host copies no longer count for their replicas; the shared copies still do
    assert index.match([hash("dead") + k for k in range(4)]) == {r: (0, 0, 4) for r in index.replicas()}
    assert index.match([hash("up") + k for k in range(4)])["r-up"] == (0, 4, 4)
