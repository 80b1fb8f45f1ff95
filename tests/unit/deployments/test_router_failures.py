"""The router when requests fail or replicas die: what it records, forgets and refuses (fake replicas, no Ray)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
from router_fakes import fake_request, make_router

from kvmesh.deployments import local_state
from kvmesh.deployments.prediction import PredictionLedger


@dataclasses.dataclass(frozen=True)
class _ReplicaID:
    unique_id: str


def fake_replica(rid: str, **stats):
    return SimpleNamespace(replica_id=_ReplicaID(rid), routing_stats=stats, node_id="n0", max_ongoing_requests=64)


@pytest.fixture(autouse=True)
def _own_ledger(monkeypatch):
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())


async def _routed(router, replicas, pending):
    chosen = (await router.choose_replicas(replicas, pending))[0][0]
    router._routed(pending, chosen.replica_id)
    return chosen


def test_only_requests_that_produced_a_token_enter_the_host_and_shared_tiers():
    """Serve reports every request as completed, failed and cancelled ones included; a prompt whose
    prefill never finished was never stored by LMCache, so the tiers must not gain it."""

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a = fake_replica("A")
        await router.choose_replicas([a], fake_request([1, 2, 3], "reg"))
        router.tiers.set_node("n0", has_shared_tier=True, host_capacity_blocks=10_000, chunk_blocks=1)
        marked = router.tiers.counters

        await _routed(router, [a], fake_request(list(range(100, 228)), "failed"))  # 4 blocks
        router.on_request_completed(a.replica_id, "i-failed")  # the engine died before its first token
        await _routed(router, [a], fake_request(list(range(300, 428)), "cancelled"))
        router.on_request_completed(a.replica_id, "i-cancelled")  # the client left while it was queued
        assert (marked["host_marked"], marked["shared_marked"]) == (0, 0)

        await _routed(router, [a], fake_request(list(range(500, 628)), "served"))
        router.first_token("served")
        router.on_request_completed(a.replica_id, "i-served")
        assert (marked["host_marked"], marked["shared_marked"]) == (4, 4)

        # a short request can complete before the ingress's first-token word reaches the router
        await _routed(router, [a], fake_request(list(range(700, 828)), "raced"))
        router.on_request_completed(a.replica_id, "i-raced")
        assert marked["host_marked"] == 4
        router.first_token("raced")
        assert (marked["host_marked"], marked["shared_marked"]) == (8, 8)

    asyncio.run(scenario())


def test_a_dead_replica_is_forgotten_at_once_and_never_chosen_again():
    """Serve (or the ingress) reports a death: index slot, speculative entries, policy state go now,
    not on the next request, and the replica is never chosen while Serve still lists it."""

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B")
        ids = list(range(100, 356))
        await router.choose_replicas([a, b], fake_request([1, 2, 3], "reg"))
        chosen = await _routed(router, [a, b], fake_request(ids, "q"))  # speculates its prefix there
        dead = chosen.replica_id.unique_id
        assert router.index.held_blocks(dead) > 0
        router.on_replica_actor_died(chosen.replica_id)
        assert dead not in router.index.replicas() and router.forgotten == 1
        assert dead not in router.policy.recent_work()
        for k in range(5):  # its prefix would draw every repeat there
            ranked = await router.choose_replicas([a, b], fake_request(ids, f"again{k}"))
            assert [g[0].replica_id.unique_id for g in ranked] == [r for r in ("A", "B") if r != dead]
        assert dead not in router.index.replicas()
        # Serve replaces it: the new replica (a new id) is added cold
        c = fake_replica("C")
        router.update_replicas([r for r in (a, b) if r.replica_id.unique_id != dead] + [c])
        assert "C" in router.index.replicas() and router.index.held_blocks("C") == 0  # before any request
        assert dead not in router.index.replicas()

    asyncio.run(scenario())


def test_a_replica_that_leaves_serves_set_is_forgotten_without_a_request():
    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B")
        await router.choose_replicas([a, b], fake_request([1, 2, 3], "reg"))
        router.update_replicas([a])
        assert router.index.replicas() == ["A"] and router.forgotten == 1

    asyncio.run(scenario())


def test_a_replica_reporting_a_broken_engine_is_not_chosen():
    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B", healthy=False)
        ranked = await router.choose_replicas([a, b], fake_request(list(range(64)), "q"))
        assert [[r.replica_id.unique_id for r in g] for g in ranked] == [["A"]]
        assert router.index.replicas() == ["A"]

    asyncio.run(scenario())
