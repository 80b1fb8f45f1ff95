"""An engine's load report is up to a stats period old and names its requests: the router counts those it
(or a peer) knows of as it knows them, and adds only the rest, the work no router here knows of."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from router_fakes import fake_request, make_router

from kvmesh.deployments import local_state
from kvmesh.deployments.prediction import PredictionLedger
from kvmesh.policies.base import RequestInfo


@pytest.fixture(autouse=True)
def _own_ledger(monkeypatch):
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())


def fake_replica(rid: str, **stats):
    return SimpleNamespace(
        replica_id=SimpleNamespace(unique_id=rid), routing_stats=stats, node_id="n0", max_ongoing_requests=64
    )


def load(router, replica) -> tuple[int, int]:
    (view,) = router._views([replica], {})
    return view.queued, view.running


async def _placed(router, replica, names):
    for k, name in enumerate(names):
        pending = fake_request(list(range(1000 * (k + 1), 1000 * (k + 1) + 64)), name)
        await router.choose_replicas([replica], pending)
        router._routed(pending, replica.replica_id)


def test_a_request_that_ended_since_the_report_is_not_counted_again_and_unknown_work_is():
    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a = fake_replica("A")
        await _placed(router, a, ["q0", "q1"])
        # the poll saw both waiting, and one request no router here placed (an ingress replica restarted)
        a.routing_stats = {"queued": 3, "running": 0, "queued_ids": ["q0", "q1", "x"], "running_ids": []}
        assert load(router, a) == (3, 0)
        router.first_token("q0")
        router._complete("A", "i-q0")  # q0 ended after the report: the report still names it
        assert load(router, a) == (2, 0)  # q1 and the unknown x; the max of the counts said 3
        a.routing_stats = {"queued": 3, "running": 0}  # a report without names: the larger count, as before
        assert load(router, a) == (3, 0)

    asyncio.run(scenario())


def test_a_request_the_engine_runs_counts_as_running_not_also_as_queued():
    """A unary call's first token reaches the router only with its end: the engine's report says it runs."""

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a = fake_replica("A")
        await _placed(router, a, ["q0"])
        a.routing_stats = {"queued": 0, "running": 1, "queued_ids": [], "running_ids": ["q0"]}
        assert load(router, a) == (0, 1)  # the max of each count said (1, 1): one request counted twice

    asyncio.run(scenario())


def test_a_peers_request_in_flight_or_ended_lately_is_known():
    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a = fake_replica("A")
        await _placed(router, a, ["q0"])
        router._complete("A", "i-q0")
        info = RequestInfo(block_hashes=[1, 2], num_tokens=64, block_size=32, expected_output_tokens=4, request_id="p0")
        msg = ["routed", "peer", "p0", "A", info.block_hashes, 64, 32, 4, None, [0, 0, 0]]
        router.peers.apply(msg)
        a.routing_stats = {"queued": 1, "running": 0, "queued_ids": ["p0"], "running_ids": []}
        assert load(router, a) == (1, 0)  # the peer's, counted once
        router.peers.apply(["done", "peer", "p0", "A"])
        assert load(router, a) == (0, 0)  # ended since the report
        assert router.peers.knows("p0") and not router.peers.knows("p1")

    asyncio.run(scenario())


def test_ended_ids_kept_are_bounded():
    from kvmesh.deployments import router as router_module

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a = fake_replica("A")
        names = [f"q{k}" for k in range(5)]
        await _placed(router, a, names)
        for name in names:
            router._complete("A", f"i-{name}")
        return router

    keep = router_module.ENDED_IDS_KEPT
    router_module.ENDED_IDS_KEPT = 3
    try:
        router = asyncio.run(scenario())
    finally:
        router_module.ENDED_IDS_KEPT = keep
    assert list(router._ended_ids) == ["q2", "q3", "q4"]


def test_a_peers_request_dropped_unheard_still_counts_where_its_engine_names_it():
    """A peer gone quiet (its registry entry lapsed, the registry restarted) is dropped: its requests may still
    run, and a report naming them counts them as work no router here knows of; one it said ended does not."""

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a = fake_replica("A")
        await _placed(router, a, ["q0"])
        router._complete("A", "i-q0")
        for name in ("p0", "p1"):
            router.peers.apply(["routed", "peer", name, "A", [1, 2], 64, 32, 4, None, [0, 0, 0]])
            router.peers.apply(["started", "peer", name, "A"])
        router.peers.apply(["done", "peer", "p1", "A"])
        a.routing_stats = {"queued": 0, "running": 2, "queued_ids": [], "running_ids": ["p0", "p1"]}
        assert load(router, a) == (0, 1)
        router.peers.drop_router("peer")
        assert load(router, a) == (0, 1)  # p0 runs on, unknown now; p1 ended as its router said

    asyncio.run(scenario())


def test_a_request_served_again_after_its_replica_refused_it_counts_as_unknown_where_a_report_names_it():
    """Serve routes a request again when its replica refuses it: this router no longer holds it there, so a
    report still naming it counts it as work no router here knows of, even when the report itself is
    unchanged (its reading is taken anew)."""

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a = fake_replica("A")
        pending = fake_request(list(range(1000, 1064)), "q0")
        await router.choose_replicas([a], pending)
        router._routed(pending, a.replica_id)
        a.routing_stats = {"queued": 1, "running": 0, "queued_ids": ["q0"], "running_ids": []}
        assert load(router, a) == (1, 0)
        router._retried(pending)
        assert load(router, a) == (1, 0)  # no longer this router's: the report's count

    asyncio.run(scenario())
