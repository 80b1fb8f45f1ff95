"""The router as Serve adds and removes engine replicas (autoscaling, nodes leaving): a new replica gets
traffic only once the router can see into it; a removed one is drained from the index, the policy and
the tier view (fake replicas, no Ray)."""

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


def fake_replica(rid: str, node: str = "n0", **stats):
    return SimpleNamespace(replica_id=_ReplicaID(rid), routing_stats=stats, node_id=node, max_ongoing_requests=64)


@pytest.fixture(autouse=True)
def _own_ledger(monkeypatch):
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())


def _ids(ranked) -> list[str]:
    return [g[0].replica_id.unique_id for g in ranked]


def test_a_new_replica_gets_no_traffic_before_its_routing_stats_arrive():
    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a = fake_replica("A", node_id="n0")
        fresh = fake_replica("B")  # Serve lists it, its first routing stats have not come yet
        for k in range(8):  # cold requests would spread over both replicas if B counted
            assert _ids(await router.choose_replicas([a, fresh], fake_request([k] * 64, f"q{k}"))) == ["A"]
        assert router.held_back == 8
        fresh.routing_stats = {"node_id": "n1"}
        seen = set()
        for k in range(8):
            seen.add(_ids(await router.choose_replicas([a, fresh], fake_request([100 + k] * 64, f"r{k}")))[0])
        assert "B" in seen
        # with no replica ready at all, requests still go somewhere
        assert _ids(await router.choose_replicas([fake_replica("C")], fake_request([7] * 64, "s"))) == ["C"]

    asyncio.run(scenario())


def test_a_removed_replica_is_drained_from_index_policy_and_tier_view():
    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b, c = (fake_replica(r, node=n, node_id=n) for r, n in (("A", "n0"), ("B", "n0"), ("C", "n1")))
        await router.choose_replicas([a, b, c], fake_request([1, 2, 3], "reg"))
        for node in ("n0", "n1"):
            router.tiers.set_node(node, has_shared_tier=True, host_capacity_blocks=1000, chunk_blocks=1)
        router.tiers.record_prefill("C", list(range(1, 9)))
        router.tiers.record_prefill("A", list(range(11, 19)))
        assert router.tiers.nodes()["n1"]["host_blocks"] == 8
        # scale down: Serve stops C (the only replica on n1) and B (n0 keeps A)
        router.update_replicas([a])
        assert router.index.replicas() == ["A"]
        assert set(router.policy.recent_work()) == {"A"}
        assert set(router.tiers.nodes()) == {"n0"} and router.tiers.nodes()["n0"]["host_blocks"] == 8
        assert router.index.nodes() == ["n0"]  # a node no replica is on is forgotten, slot and all
        # what C computed is still in the shared tier (Redis outlives the node), not on any host
        assert router.index.match(list(range(1, 9))) == {"A": (0, 0, 8)}
        for k in range(4):  # nothing new goes to a removed replica, even if a stale candidate list names it
            ranked = await router.choose_replicas([a], fake_request(list(range(64)), f"q{k}"))
            assert _ids(ranked) == ["A"]

    asyncio.run(scenario())


def test_predicted_cached_tokens_follow_vllm_for_hbm_and_lmcache_for_tiers():
    from kvmesh.deployments.prediction import predicted_cached_tokens

    assert predicted_cached_tokens(10, 10, 320, 32) == 288  # own cache: the last block is recomputed
    assert predicted_cached_tokens(0, 10, 320, 32) == 319  # LMCache: all but the last token
    assert predicted_cached_tokens(4, 10, 320, 32) == 319
    assert predicted_cached_tokens(0, 4, 320, 32) == 128  # a prefix of the prompt: its whole blocks
    assert predicted_cached_tokens(0, 0, 320, 32) == 0


def test_replicas_are_subscribed_when_serve_lists_them_not_at_the_first_request():
    """A replica's KV events are subscribed as soon as Serve's replica update names its endpoint, in the
    background: an app that answers is then ready for a whole burst, instead of sending the first requests
    to the replica subscribed first."""

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        router.subscribe_events = True
        subscribed = []

        async def subscribe(rid, stats):
            await asyncio.sleep(0.01)  # a subscription yields; a second update meanwhile must not be lost
            subscribed.append(rid)
            router._subscribed.add(rid)

        router._subscribe = subscribe
        a = fake_replica("A", node_id="n0", kv_events_endpoint="tcp://127.0.0.1:1")
        b = fake_replica("B")  # its routing stats have not come yet
        router.update_replicas([a, b])
        b2 = fake_replica("B", node_id="n1", kv_events_endpoint="tcp://127.0.0.1:2")
        router.update_replicas([a, b2])  # while A's subscription is under way
        await asyncio.sleep(0.1)
        return subscribed, router.readiness(), router.held_back

    subscribed, readiness, held_back = asyncio.run(scenario())
    assert subscribed == ["A", "B"]  # each once, with no request routed yet
    assert readiness == {"listed": 2, "ready": 2} and held_back == 0


def test_readiness_counts_only_replicas_the_router_can_see_into():
    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        router.subscribe_events = True
        router._subscribe = lambda rid, stats: asyncio.sleep(3600)  # never completes in this test
        router.update_replicas([fake_replica("A", kv_events_endpoint="tcp://127.0.0.1:1"), fake_replica("B")])
        await asyncio.sleep(0.01)
        return router.readiness()

    assert asyncio.run(scenario()) == {"listed": 2, "ready": 0}  # A unsubscribed, B without stats


def test_the_app_waits_for_the_engines_it_starts_with():
    from kvmesh.deployments.app import initial_engine_replicas

    assert initial_engine_replicas({"replicas": 3, "autoscaling": None}) == 3
    assert initial_engine_replicas({"replicas": 3, "autoscaling": {"min_replicas": 1, "max_replicas": 4}}) == 1
    auto = {"min_replicas": 1, "initial_replicas": 2, "max_replicas": 4}
    assert initial_engine_replicas({"replicas": 3, "autoscaling": auto}) == 2


def test_a_request_placed_on_a_replica_forgotten_since_it_was_ranked_leaves_it_forgotten():
    """Serve may still send a request to a replica the router forgot after ranking it (the ingress saw it
    fail; autoscaling removed it during a hold): the policy must not get its slot back, since nothing
    would remove it again."""

    async def run():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B")
        await router.choose_replicas([a, b], fake_request([1, 2, 3], "warm"))
        p = fake_request(list(range(500, 800)), "p")
        second = (await router.choose_replicas([a, b], p))[1][0]
        router.replica_failed(second.replica_id.unique_id)
        router._routed(p, second.replica_id)  # Serve's placement, the first choice being full
        assert sorted(router.policy.recent_work()) == sorted(router.index.replicas())
        assert second.replica_id.unique_id not in router.policy.recent_work()

    asyncio.run(run())


def test_a_replica_known_dead_is_not_added_back_by_a_list_from_before_it_died():
    """A background sync may run with the replica list of an earlier request: a replica that died since
    stays out of the index (peers' placements would speculate onto it)."""

    async def run():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B")
        await router.choose_replicas([a, b], fake_request([1, 2, 3], "warm"))
        router.replica_failed("B")
        await router._sync_replicas([a, b])
        assert router.index.replicas() == ["A"] and "B" not in router.policy.recent_work()

    asyncio.run(run())
