"""The engines' load reports are up to a stats period old: the router takes off a report what it (and its peers)
saw leave that engine's queue or running batch since the report arrived, so a replica that just finished work
is not ranked as still busy, while work no router here knows of still counts."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
from router_fakes import make_router

from kvmesh.deployments import local_state
from kvmesh.deployments.prediction import PredictionLedger


@dataclasses.dataclass(frozen=True)
class _ReplicaID:  # hashable, as Serve's `update_replicas` needs
    unique_id: str


@pytest.fixture(autouse=True)
def _own_ledger(monkeypatch):
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())


def fake_replica(rid: str, **stats):
    return SimpleNamespace(replica_id=_ReplicaID(rid), routing_stats=stats, node_id="n0", max_ongoing_requests=64)


class Wire:
    """Stands in for RouterSync: collects what a router publishes, for `relay` to hand to another."""

    def __init__(self, router_id: str):
        self.router_id = router_id
        self.sent: list[list] = []

    def publish(self, msg: list) -> None:
        self.sent.append(msg)

    def drain(self) -> int:
        return 0


def relay(src, dst) -> None:
    for msg in src.sync.sent:
        dst.peers.apply(msg)
    src.sync.sent.clear()


def fake_request(ids, request_id):
    req = {"request_id": request_id, "prompt_token_ids": ids, "cache_salt": None, "params": {"max_tokens": 4}}
    return SimpleNamespace(args=[req], kwargs={}, metadata=SimpleNamespace(internal_request_id="i-" + request_id))


def load(router, replicas) -> dict[str, tuple[int, int]]:
    return {v.replica_id: (v.queued, v.running) for v in router._views(replicas, {})}


async def _placed_on_a(router, a, n: int) -> list[str]:
    """`n` requests placed on A (the only candidate), in flight without a first token."""
    names = []
    for k in range(n):
        pending = fake_request(list(range(1000 * (k + 1), 1000 * (k + 1) + 64)), f"q{k}")
        await router.choose_replicas([a], pending)
        router._routed(pending, a.replica_id)
        names.append(f"q{k}")
    return names


def test_requests_seen_to_start_and_end_after_the_report_come_off_it():
    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a = fake_replica("A")
        names = await _placed_on_a(router, a, 3)
        a.routing_stats = {"queued": 3, "running": 0, "steps": 7}  # the poll saw the three waiting
        assert load(router, [a]) == {"A": (3, 0)}
        for name in names[:2]:
            router.first_token(name)
        assert load(router, [a]) == {"A": (1, 2)}  # not 3 queued: two left the queue since the report
        for name in names:
            router.on_request_completed(a.replica_id, "i-" + name)
        assert load(router, [a]) == {"A": (0, 0)}  # the old code kept the report's 3 queued

    asyncio.run(scenario())


def test_a_report_arriving_between_rankings_counts_the_changes_after_it():
    """No ranking (nor Serve's `update_replicas`) between the report's arrival and the completions: the
    completions themselves take the report's snapshot before they change anything."""

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a = fake_replica("A", queued=3, running=0, steps=1)
        names = await _placed_on_a(router, a, 2)
        a.routing_stats = {"queued": 2, "running": 0, "steps": 2}
        for name in names:
            router.on_request_completed(a.replica_id, "i-" + name)
        assert load(router, [a]) == {"A": (0, 0)}

    asyncio.run(scenario())


def test_a_new_report_resets_the_discount_and_an_equal_copy_does_not():
    """Serve hands every router a new copy of all replicas' stats whenever any changes: the same content is the
    same report. A changed one is the engine's word again, work unknown here included."""

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B")
        await router.choose_replicas([a, b], fake_request([1, 2, 3], "reg"))
        names = await _placed_on_a(router, a, 2)
        a.routing_stats = {"queued": 2, "running": 0, "steps": 4}
        router.update_replicas([a, b])  # Serve's broadcast: the report arrived
        for name in names:
            router.on_request_completed(a.replica_id, "i-" + name)
        b.routing_stats = {"queued": 0, "running": 0, "steps": 9}
        a.routing_stats = dict(a.routing_stats)  # B's report changed: A's comes again, unchanged
        router.update_replicas([a, b])
        assert load(router, [a, b])["A"] == (0, 0)
        a.routing_stats = {"queued": 2, "running": 1, "steps": 5}  # a new poll: two queued no router here sent
        assert load(router, [a, b])["A"] == (2, 1)

    asyncio.run(scenario())


def test_work_the_router_does_not_know_of_still_counts():
    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a = fake_replica("A")
        names = await _placed_on_a(router, a, 2)
        a.routing_stats = {"queued": 5, "running": 4, "steps": 3}  # three queued, four running from elsewhere
        assert load(router, [a]) == {"A": (5, 4)}
        for name in names:
            router.on_request_completed(a.replica_id, "i-" + name)
        assert load(router, [a]) == {"A": (3, 4)}  # the old code kept 5

    asyncio.run(scenario())


def test_a_rejected_call_does_not_come_off_its_replicas_report():
    """The replica refused it: its queue never held it, so the report's count stays."""

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B")
        (name,) = await _placed_on_a(router, a, 1)
        a.routing_stats = {"queued": 3, "running": 0, "steps": 3}
        assert load(router, [a, b])["A"] == (3, 0)
        pending = fake_request(list(range(1000, 1064)), name)
        await router.choose_replicas([b], pending)  # Serve routes it again after A rejected it
        router._routed(pending, b.replica_id)
        assert load(router, [a, b])["A"] == (3, 0)

    asyncio.run(scenario())


def test_peers_requests_seen_to_start_and_end_come_off_the_report_too():
    async def scenario():
        peer, router = make_router(policy="kvmesh", block_size=32), make_router(policy="kvmesh", block_size=32)
        peer.sync = Wire("P")
        a = fake_replica("A")
        reg = fake_request([1, 2, 3], "reg")  # registers A with this router
        await router.choose_replicas([a], reg)
        router._routed(reg, a.replica_id)
        router.on_request_completed(a.replica_id, "i-reg")
        names = await _placed_on_a(peer, a, 3)
        relay(peer, router)
        a.routing_stats = {"queued": 3, "running": 0, "steps": 2}
        assert load(router, [a]) == {"A": (3, 0)}
        peer.first_token(names[0])
        peer.on_request_completed(a.replica_id, "i-" + names[1])
        relay(peer, router)
        assert load(router, [a]) == {"A": (1, 1)}
        peer.on_request_completed(a.replica_id, "i-" + names[0])
        relay(peer, router)
        assert load(router, [a]) == {"A": (1, 0)}

    asyncio.run(scenario())


def test_a_replica_that_leaves_leaves_no_report_state():
    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A", queued=1), fake_replica("B", queued=0)
        await router.choose_replicas([a, b], fake_request([1, 2, 3], "reg"))
        assert set(router._since) == {"A", "B"}
        router.update_replicas([b])
        assert set(router._since) == {"B"}
        router.replica_failed("B")
        assert router._since == {}

    asyncio.run(scenario())
