"""Router-to-router placement sync without sockets: what one router publishes, another applies."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
from router_fakes import fake_request

from kvmesh.deployments.peer_lag import UnseenPlacements
from kvmesh.deployments.router_sync import PeerPlacements, routed_message
from kvmesh.policies.base import RequestInfo


def fake_replica(rid: str):
    return SimpleNamespace(
        replica_id=SimpleNamespace(unique_id=rid), routing_stats={}, node_id="n0", max_ongoing_requests=64
    )


class Wire:
    """Stands in for RouterSync (kvmesh's own interface): collects what a router publishes."""

    def __init__(self, router_id: str):
        self.router_id = router_id
        self.sent: list[list] = []

    def publish(self, msg: list) -> None:
        self.sent.append(msg)

    def drain(self) -> int:  # `relay` delivers the messages here
        return 0

    def stats(self) -> dict:
        return {}


def make_router(name: str):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from kvmesh.deployments.router import KvmeshRouter

    r = KvmeshRouter(
        deployment_id=DeploymentID(name="EngineReplica", app_name="t"), handle_source=DeploymentHandleSource.UNKNOWN
    )
    r.initialize_state(subscribe_events=False, policy="kvmesh", block_size=32)
    r.sync = Wire(name)
    return r


def relay(src, dst) -> None:
    for msg in src.sync.sent:
        dst.peers.apply(msg)
    src.sync.sent.clear()


REPLICAS = [fake_replica(f"r{i}") for i in range(4)]


def _first(ranked) -> str:
    return ranked[0][0].replica_id.unique_id


def test_a_new_prefix_sent_through_two_routers_lands_on_one_replica():
    async def scenario():
        a, b = make_router("A"), make_router("B")
        for r in (a, b):
            await r.choose_replicas(REPLICAS, fake_request([1, 2, 3], f"reg-{id(r)}"))
            r.sync.sent.clear()
        # B's own traffic so far differs from A's: two short requests still in flight
        for k in range(2):
            own = fake_request(list(range(90_000 + 1000 * k, 90_000 + 1000 * k + 64)), f"own{k}")
            b._routed(own, SimpleNamespace(unique_id=_first(await b.choose_replicas(REPLICAS, own))))
        b.sync.sent.clear()
        prefixes = [list(range(10_000 * k, 10_000 * k + 1280)) for k in range(1, 9)]
        for k, ids in enumerate(prefixes):
            pending = fake_request(ids, f"a{k}")
            where = _first(await a.choose_replicas(REPLICAS, pending))
            a._routed(pending, SimpleNamespace(unique_id=where))
            relay(a, b)
            # the same new prefix (another user, through the other front) goes where A sent it
            again = fake_request(ids + [7, 7, 7], f"b{k}")
            assert _first(await b.choose_replicas(REPLICAS, again)) == where
            b._routed(again, SimpleNamespace(unique_id=where))
            relay(b, a)

    asyncio.run(scenario())


def test_peer_load_counts_in_the_views_and_leaves_when_the_request_does():
    async def scenario():
        a, b = make_router("A"), make_router("B")
        for r in (a, b):
            reg = fake_request([1, 2, 3], f"reg-{id(r)}")
            where = _first(await r.choose_replicas(REPLICAS, reg))
            r._routed(reg, SimpleNamespace(unique_id=where))
            r.on_request_completed(SimpleNamespace(unique_id=where), f"i-reg-{id(r)}")  # over before the test
            r.sync.sent.clear()
        placed = {}
        for k in range(6):
            pending = fake_request(list(range(5000 * (k + 1), 5000 * (k + 1) + 256)), f"a{k}")
            where = _first(await a.choose_replicas(REPLICAS, pending))
            a._routed(pending, SimpleNamespace(unique_id=where))
            placed[f"a{k}"] = where
        relay(a, b)
        pending = b.peers.pending()
        expected: dict[str, int] = {}
        for where in placed.values():
            expected[where] = expected.get(where, 0) + 1
        assert {r: row[0] for r, row in pending.items()} == expected
        assert sum(row[2] for row in pending.values()) == 6 * 256  # cold prompts: all prefill pending
        views = {v.replica_id: v for v in b._views(REPLICAS, {})}
        assert sum(v.queued for v in views.values()) == 6
        # first tokens, then completions, travel too
        for k in range(6):
            a.first_token(f"a{k}")
        relay(a, b)
        assert sum(row[2] for row in b.peers.pending().values()) == 0
        for k in range(6):
            a.on_request_completed(SimpleNamespace(unique_id=placed[f"a{k}"]), f"i-a{k}")
        relay(a, b)
        assert b.peers.pending() == {}

    asyncio.run(scenario())


def _peer_view():
    """A router's index and kvmesh policy over r0 and r1, the peer placements applied to them, what they held
    before, and a 4-block request of router A's."""
    from kvmesh.cluster.index import PrefixIndex
    from kvmesh.policies.registry import make_policy

    index = PrefixIndex(max_blocks=10_000)
    policy = make_policy("kvmesh")
    for rid in ("r0", "r1"):
        index.add_replica(rid)
        policy.on_replica_added(rid)
    peers = PeerPlacements(index, lambda: [policy])
    before = (policy._w.copy(), index.held_blocks("r1"))
    info = RequestInfo(block_hashes=[11, 12, 13, 14], num_tokens=130, block_size=32, request_id="q")
    return index, policy, peers, before, info


def test_a_withdrawn_peer_placement_is_taken_back_exactly():
    index, policy, peers, before, info = _peer_view()
    peers.apply(routed_message("A", info, "r1", (0, 0, 0)))
    assert index.held_blocks("r1") == 4
    assert policy._w.sum() > before[0].sum()
    peers.apply(["unrouted", "A", "q", "r1"])
    assert index.held_blocks("r1") == before[1]
    assert np.array_equal(policy._w, before[0])
    assert peers.pending() == {}


def test_a_placement_withdrawn_after_its_rejected_calls_done_is_taken_back_exactly():
    """A replica rejected the request and Serve reported that call complete before routing it again: the
    peer hears routed, done, then unrouted, and takes the credit and speculative blocks back all the same."""
    index, policy, peers, before, info = _peer_view()
    peers.apply(routed_message("A", info, "r1", (0, 0, 0)))
    peers.apply(["done", "A", "q", "r1"])
    peers.apply(["unrouted", "A", "q", "r1"])
    assert index.held_blocks("r1") == before[1]
    assert np.array_equal(policy._w, before[0])
    assert peers.ended == {} and peers.pending() == {}


def test_a_peer_that_says_bye_no_longer_counts():
    from kvmesh.cluster.index import PrefixIndex

    index = PrefixIndex(max_blocks=1000)
    index.add_replica("r0")
    peers = PeerPlacements(index, lambda: [])
    for q in ("q1", "q2"):
        info = RequestInfo(block_hashes=[1, 2], num_tokens=64, block_size=32, request_id=q)
        peers.apply(routed_message("A", info, "r0", (0, 0, 0)))
    peers.apply(
        routed_message(
            "B", RequestInfo(block_hashes=[3], num_tokens=32, block_size=32, request_id="q3"), "r0", (0, 0, 0)
        )
    )
    assert peers.pending()["r0"][0] == 3
    peers.apply(["bye", "A", "", ""])
    assert peers.pending()["r0"][0] == 1
    peers.expire(now=1e12)
    assert peers.pending() == {}


def test_unseen_placements_are_the_peers_rate_times_the_lag():
    unseen = UnseenPlacements(window_s=2.0)
    assert unseen.estimate(0.0) == (0.0, 0.0)
    # 100 placements a second for 2 s, each heard 0.1 s after it was made: 10 unseen at any time
    for k in range(200):
        t = k / 100
        unseen.heard(t, t + 0.1, 300.0 if k % 2 else 100.0)
    count, tokens = unseen.estimate(2.1)
    assert abs(count - 10.0) < 0.3
    assert abs(tokens - 200.0) < 1.0  # the mean prefill work of what was heard in the window
    unseen.heard(5.0, 4.9, 100.0)  # a clock behind the peer's: no lag, not a negative one
    assert unseen.estimate(5.0)[0] == 0.0
    assert unseen.estimate(100.0) == (0.0, 0.0)  # nothing heard lately: nothing unseen


def _peers_at_a_fixed_clock() -> tuple[PeerPlacements, RequestInfo]:
    """Peer placements on one replica, read at a clock standing at 1000 s, and a two-block request."""
    from kvmesh.cluster.index import PrefixIndex

    index = PrefixIndex(max_blocks=1000)
    index.add_replica("r0")
    peers = PeerPlacements(index, lambda: [], clock=lambda: 1000.0)
    return peers, RequestInfo(block_hashes=[1, 2], num_tokens=64, block_size=32, request_id="q1")


def test_a_stamped_peer_placement_measures_the_lag():
    peers, info = _peers_at_a_fixed_clock()
    msg = routed_message("A", info, "r0", (1, 1, 1), sent_at=999.5)
    peers.apply(msg)
    count, tokens = peers.unseen_placements()
    assert count == 0.5 / peers.unseen.window_s  # one placement, heard 0.5 s late
    assert tokens == 32  # 64 prompt tokens, one block cached there
    peers.apply(msg[:10])  # a peer without stamps (an older version): applied, no lag measured
    assert peers.pending()["r0"][0] == 1
    assert peers.unseen_placements()[0] == count


def test_a_placement_is_free_unless_one_replica_alone_holds_the_longest_prefix():
    from kvmesh.deployments.peer_lag import is_free_choice

    assert is_free_choice([0, 0, 0])  # nothing cached: any replica
    assert is_free_choice([4, 4, 1])  # a shared prompt two replicas hold
    assert not is_free_choice([2, 9, 2])  # a conversation's history on one replica
    assert not is_free_choice(np.array([0, 3]))
    assert is_free_choice([5])  # one candidate: nothing to compete for, counted as before


def test_only_free_peer_placements_count_as_unseen_but_all_count_towards_their_mean_work():
    unseen = UnseenPlacements(window_s=2.0)
    # 100 placements a second, heard 0.1 s late; every other one a next turn bound to its history
    for k in range(200):
        t = k / 100
        unseen.heard(t, t + 0.1, 300.0 if k % 2 else 100.0, free=bool(k % 2))
    count, tokens = unseen.estimate(2.1)
    assert abs(count - 5.0) < 0.3  # the free half: 50 a second x 0.1 s
    assert abs(tokens - 200.0) < 1.0
    assert unseen.count == 200 and abs(unseen.lag_total - 20.0) < 1e-6  # the stream's latency: every message


def test_a_peer_placement_says_whether_it_was_free():
    peers, info = _peers_at_a_fixed_clock()
    peers.apply(routed_message("A", info, "r0", (1, 1, 1), sent_at=999.5, free=False))
    assert peers.unseen_placements() == (0.0, 32.0)
    info2 = RequestInfo(block_hashes=[3, 4], num_tokens=64, block_size=32, request_id="q2")
    peers.apply(routed_message("A", info2, "r0", (0, 0, 0), sent_at=999.5))
    assert peers.unseen_placements()[0] == 0.5 / peers.unseen.window_s


def test_a_prompt_another_router_placed_counts_as_computed_in_this_routers_miss_attribution(monkeypatch):
    """Router A's request gets its first token; router B hears it on the stream. B's next request on the
    same prompt then finds the prompt computed (a miss on it is evicted or misrouted, not cold), though
    B's own ingress never delivered it."""
    from kvmesh.deployments import miss_attribution

    monkeypatch.setattr(miss_attribution, "ATTRIBUTION", miss_attribution.MissAttribution())
    prompt = list(range(100, 356))  # 8 full blocks

    async def scenario():
        a, b = make_router("A"), make_router("B")
        for r in (a, b):
            await r.choose_replicas(REPLICAS, fake_request([1, 2, 3], f"reg-{id(r)}"))
            r.sync.sent.clear()
        q1 = fake_request(prompt, "q1")
        q1.args[0]["tenant"] = "t"
        where = _first(await a.choose_replicas(REPLICAS, q1))
        a._routed(q1, SimpleNamespace(unique_id=where))
        relay(a, b)
        q2 = fake_request(prompt, "q2")
        q2.args[0]["tenant"] = "t"
        b._routed(q2, SimpleNamespace(unique_id=_first(await b.choose_replicas(REPLICAS, q2))))
        before = miss_attribution.ATTRIBUTION.explain("q2")["seen_at_placement"]
        a.first_token("q1")
        relay(a, b)
        q3 = fake_request(prompt, "q3")
        q3.args[0]["tenant"] = "t"
        b._routed(q3, SimpleNamespace(unique_id=_first(await b.choose_replicas(REPLICAS, q3))))
        return before, miss_attribution.ATTRIBUTION.explain("q3")["seen_at_placement"]

    before, after = asyncio.run(scenario())
    assert before == 0  # q1 had been placed, not computed, when q2 was
    assert after == 8


def test_a_late_peer_placement_on_a_replica_this_router_forgot_does_not_bring_it_back():
    """Routers hear of a removed replica at different moments: a peer's placement on it that arrives after
    this router forgot it must not give the policy a slot no later removal would clear (a slot that counts
    in the guard's fleet mean for the life of the process)."""

    async def run():
        a, b = make_router("A"), make_router("B")
        for r in (a, b):
            await r.choose_replicas(REPLICAS, fake_request([1, 2, 3], f"warm-{r.sync.router_id}"))
            r.sync.sent.clear()
        target = _first(await a.choose_replicas(REPLICAS, fake_request(list(range(5000, 5320)), "late")))
        b._forget(target)
        assert target not in b.policy.recent_work()
        relay(a, b)  # A had not heard yet
        assert target not in b.policy.recent_work()
        assert sorted(b.policy.recent_work()) == sorted(b.index.replicas())

    asyncio.run(run())


def test_a_peer_request_running_past_the_ttl_counts_while_its_router_names_it_live():
    """A peer placement whose `done` never comes expires after PLACEMENT_TTL_S; one its router names in a
    `live` message (a long generation) keeps counting as load and towards its tenant's fleet-wide
    concurrency for as long as it runs."""
    from kvmesh.cluster.index import PrefixIndex
    from kvmesh.deployments.router_sync import LIVE_EVERY_S, PLACEMENT_TTL_S, RouterSync

    now = [1000.0]
    index = PrefixIndex(max_blocks=10_000)
    index.add_replica("r0")
    peers = PeerPlacements(index, lambda: [])
    peers.monotonic = lambda: now[0]
    for rid in ("long", "lost"):
        info = RequestInfo(block_hashes=[1, 2], num_tokens=70, block_size=32, request_id=rid, tenant="acme")
        peers.apply(routed_message("A", info, "r0", (0, 0, 0)))
    assert peers.tenants.active("acme") == 2

    peer = RouterSync("t", PeerPlacements(index, lambda: []))
    peer.router_id = "A"
    sent: list[list] = []
    peer.publish = sent.append  # type: ignore[method-assign]
    peer.own_requests = lambda: ["long"]
    start, peer_start = now[0], peer._live_at
    while now[0] - start <= PLACEMENT_TTL_S + LIVE_EVERY_S:  # the peer's discovery loop, once a second
        now[0] += 1.0
        peer.publish_live(peer_start + now[0] - start)
        for msg in sent:
            peers.apply(msg)
        sent.clear()
        peers.expire()
    assert [key[1] for key in peers.placements] == ["long"]
    assert peers.tenants.active("acme") == 1 and peers.pending() == {"r0": [1, 0, 70]}


def test_a_malformed_peer_message_drops_itself_not_the_rest_of_its_frame():
    """A peer's `done`s after one bad message of the same frame still end its requests here."""
    import msgpack

    from kvmesh.cluster.index import PrefixIndex
    from kvmesh.deployments.router_sync import RouterSync

    index = PrefixIndex()
    index.add_replica("r0")
    peers = PeerPlacements(index, lambda: [])
    sync = RouterSync("t", peers)  # no sockets: `_apply` is the drain's step per frame

    def info(q, tenant="acme"):
        return RequestInfo(block_hashes=[1, 2], num_tokens=64, block_size=32, tenant=tenant, request_id=q)

    routed = [routed_message("A", info(q), "r0", (0, 0, 0)) for q in ("q1", "q2", "q3")]
    sync._apply(msgpack.packb(["batch", "A", "", "", routed]))
    assert peers.tenants.active("acme") == 3
    dones = [["live", "A", "", ""]] + [["done", "A", q, "r0"] for q in ("q1", "q2", "q3")]  # `live` lacks its list
    sync._apply(msgpack.packb(["batch", "A", "", "", dones]))
    assert peers.pending() == {} and peers.tenants.active("acme") == 0
    assert sync.stats()["bad_messages"] == 1
    for payload in (7, None, "x"):  # a batch whose payload is no list: the frame is dropped, nothing raised
        assert sync._apply(msgpack.packb(["batch", "A", "", "", payload])) == 1


def test_a_malformed_routed_message_leaves_nothing_behind_and_a_bad_stamp_no_nan():
    from kvmesh.cluster.index import PrefixIndex

    index = PrefixIndex()
    index.add_replica("r0")
    peers = PeerPlacements(index, lambda: [])
    bad = routed_message(
        "A", RequestInfo(block_hashes=[1, 2], num_tokens=64, block_size=32, request_id="q"), "r0", (0, 0, 0)
    )
    bad[8] = ["not", "a", "tenant"]
    with pytest.raises(TypeError):
        peers.apply(bad)
    assert index.match([1, 2])["r0"] == (0, 0, 0) and peers.placements == {}
    stamped = routed_message(
        "A", RequestInfo(block_hashes=[3], num_tokens=64, block_size=32, request_id="s"), "r0", (0, 0, 0)
    )
    stamped[10] = float("nan")
    peers.apply(stamped)
    count, tokens = peers.unseen_placements()
    assert count == count and tokens == tokens  # not NaN


def _tenant_peers():
    from kvmesh.cluster.index import PrefixIndex

    index = PrefixIndex(max_blocks=10_000)
    index.add_replica("r0")
    index.add_replica("r1")
    now = [1000.0]
    peers = PeerPlacements(index, lambda: [])
    peers.monotonic = lambda: now[0]
    return peers, index, now


def _logged(peers, tenant="acme") -> list[int]:
    return [tokens for _, tokens in peers.tenants.since(tenant, 0)[1]]


def test_a_held_request_counts_for_its_tenant_once_from_its_commit_until_whatever_ends_it():
    """A peer's request held for a prefix in flight (`held`) counts towards its tenant's fleet-wide limits from
    its commit, without crediting a replica or a prefix; its `routed` takes the claim over (one request in
    flight, logged once), and its `unrouted`, `done`, the peer's `bye` or the TTL end it, once."""
    from kvmesh.deployments.router_sync import PLACEMENT_TTL_S, held_message

    def info(q, n=64):
        return RequestInfo(block_hashes=[1, 2], num_tokens=n, block_size=32, tenant="acme", request_id=q)

    peers, index, now = _tenant_peers()
    peers.apply(held_message("A", info("q", 96)))
    peers.apply(held_message("A", info("q", 96)))  # said twice: still one request
    assert peers.tenants.active("acme") == 1 and _logged(peers) == [96]
    assert peers.pending() == {} and index.match([1, 2])["r0"] == (0, 0, 0)  # no replica, no prefix
    peers.apply(routed_message("A", info("q", 96), "r0", (0, 0, 0)))  # the hold ended: sent
    assert peers.tenants.active("acme") == 1 and _logged(peers) == [96] and not peers.held
    assert peers.pending() == {"r0": [1, 0, 96]}
    peers.apply(held_message("A", info("q", 96)))  # late or repeated: the placement already counts it
    assert peers.tenants.active("acme") == 1 and not peers.held
    peers.apply(["done", "A", "q", "r0"])
    assert peers.tenants.active("acme") == 0 and _logged(peers) == [96]

    ends = {
        "unrouted": lambda: peers.apply(["unrouted", "A", "h", ""]),  # cancelled while held
        "done": lambda: peers.apply(["done", "A", "h", "r0"]),  # sent, its `routed` lost
        "bye": lambda: peers.apply(["bye", "A", "", ""]),
        "forgotten": lambda: peers.drop_router("A"),  # its heartbeat stopped
        "ttl": lambda: (now.__setitem__(0, now[0] + PLACEMENT_TTL_S + 1), peers.expire()),
    }
    for name, end in ends.items():
        peers.apply(held_message("A", info("h")))
        assert peers.tenants.active("acme") == 1, name
        end()
        assert peers.tenants.active("acme") == 0 and not peers.held, name
        end()  # said again: nothing more to release
        assert peers.tenants.active("acme") == 0, name
    # named live by its router (its `routed` lost, the request running long) it outlives the TTL
    peers.apply(held_message("A", info("l")))
    for _ in range(3):
        now[0] += PLACEMENT_TTL_S / 2
        peers.apply(["live", "A", "", "", ["l"]])
        peers.expire()
    assert peers.tenants.active("acme") == 1


def test_a_peers_request_on_a_forgotten_replica_counts_for_its_tenant_until_it_ends():
    """Serve stops listing a replica it scales down, which goes on running its requests for its drain time:
    forgetting it takes the peers' placements there off its load, prefixes and policies, but they go on
    counting towards their tenant's fleet-wide limits (`live` renews them) until their `done`, their router's
    `bye` or the TTL. Dropped with the replica, they freed a whole max_concurrent for this ingress replica to
    admit on top of them."""
    from kvmesh.deployments.admission import Admission, RateLimited
    from kvmesh.deployments.router_sync import PLACEMENT_TTL_S
    from kvmesh.deployments.tenants import Limits, Tenant

    def info(q):
        return RequestInfo(block_hashes=[1, 2], num_tokens=64, block_size=32, tenant="acme", request_id=q)

    peers, index, now = _tenant_peers()
    admission = Admission(clock=lambda: now[0], peers=peers.tenants)
    acme = Tenant("acme", None, "s" * 64, Limits(max_concurrent=2))
    for q in ("q1", "q2"):
        peers.apply(routed_message("B", info(q), "r0", (0, 0, 0)))
    peers.forget_replica("r0")
    index.remove_replica("r0")
    assert peers.pending() == {} and not peers.placements  # no load, no placement on the replica gone
    assert peers.tenants.active("acme") == 2 and _logged(peers) == [64, 64]  # still running: logged once
    now[0] += PLACEMENT_TTL_S * 0.75
    peers.apply(["live", "B", "", "", ["q1", "q2"]])
    now[0] += PLACEMENT_TTL_S * 0.75
    peers.expire()
    assert peers.tenants.active("acme") == 2
    with pytest.raises(RateLimited, match="concurrent"):
        admission.try_acquire(acme, 10)
    peers.apply(["done", "B", "q1", "r0"])
    assert peers.tenants.active("acme") == 1
    admission.release(admission.try_acquire(acme, 10))  # one slot free again
    peers.apply(["bye", "B", "", ""])
    assert peers.tenants.active("acme") == 0 and not peers.held
    peers.apply(routed_message("B", info("q3"), "r1", (0, 0, 0)))
    peers.forget_replica("r1")
    now[0] += PLACEMENT_TTL_S + 1
    peers.expire()
    assert peers.tenants.active("acme") == 0 and not peers.held  # unheard of for the TTL: over


def test_a_held_message_without_a_tenant_string_is_dropped_whole_and_an_unknown_kind_ignored():
    peers, _, _ = _tenant_peers()
    with pytest.raises(TypeError):
        peers.apply(["held", "A", "q", "", ["acme"], 64])
    assert not peers.held and peers.tenants.active("acme") == 0
    peers.apply(["a-later-kind", "A", "q", "r0", "acme", 64])  # what an older peer does with `held`
    assert not peers.held and not peers.placements and peers.tenants.active("acme") == 0
    routed_to_a_list = ["routed", "A", "q", ["r0"], [1], 64, 32, 4, "acme", [0, 0, 0]]
    for bad in (["held", "A", 7, "", "acme", 64], ["held", None, "q", "", "acme", 64], routed_to_a_list):
        with pytest.raises(TypeError):
            peers.apply(bad)
        assert not peers.held and not peers.placements and peers.tenants.active("acme") == 0
    peers.expire(now=10**9)  # nothing half-kept for the expiry to trip on later


def test_a_migrated_streams_continuation_is_the_same_request_for_its_tenant_on_peers():
    """A stream continued on another replica has an engine request id of its own and a longer prompt (the
    tokens already sent). The owning ingress charged the request once; its peers must not log it again (it
    would take 6000 more prompt tokens from the tenant's budget there), while its in-flight count and load
    follow it to its new replica, counted once even while its first call's `done` is still on its way."""
    from kvmesh.deployments.admission import Admission
    from kvmesh.deployments.migration import continuation
    from kvmesh.deployments.tenants import Limits, Tenant

    def info_of(req):  # as the router builds it from the engine request
        return RequestInfo(
            block_hashes=[1],
            num_tokens=len(req["prompt_token_ids"]),
            block_size=32,
            expected_output_tokens=int(req["params"]["max_tokens"]),
            tenant=req["tenant"],
            request_id=req["request_id"],
        )

    req = {"request_id": "q", "prompt_token_ids": list(range(4000)), "tenant": "acme", "params": {"max_tokens": 3000}}
    cont = continuation(req, list(range(2000)), 1)
    assert cont["request_id"] != "q"
    for done_first in (True, False):
        peers, _, _ = _tenant_peers()
        peers.apply(routed_message("A", info_of(req), "r0", (0, 0, 0)))
        peers.apply(["started", "A", "q", "r0"])
        if done_first:
            peers.apply(["done", "A", "q", "r0"])  # r0 died after 2000 tokens streamed
        peers.apply(routed_message("A", info_of(cont), "r1", (0, 0, 0)))
        assert peers.tenants.active("acme") == 1 and _logged(peers) == [4000]
        assert peers.pending()["r1"] == [1, 0, 6000]  # its load is on its new replica
        if not done_first:
            peers.apply(["done", "A", "q", "r0"])
            assert peers.tenants.active("acme") == 1
        peers.apply(["started", "A", cont["request_id"], "r1"])
        peers.apply(["done", "A", cont["request_id"], "r1"])
        assert peers.tenants.active("acme") == 0 and _logged(peers) == [4000] and peers.pending() == {}
    # what that leaves this ingress replica: a 2000-token request of the tenant fits its 10,000 a minute
    clock = peers.tenants.clock
    admission = Admission(clock=clock, peers=peers.tenants)
    tenant = Tenant("acme", None, "s", Limits(tokens_per_min=10_000))
    admission.release(admission.try_acquire(tenant, 2000))


class _CountedPlacements(dict):
    """Peer placements that count how often they are walked."""

    walks = 0

    def values(self):
        type(self).walks += 1
        return super().values()

    def items(self):
        type(self).walks += 1
        return super().items()

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


def _recount(peers: PeerPlacements) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for p in dict.values(peers.placements):
        row = out.setdefault(p.replica, [0, 0, 0])
        row[0] += 1
        row[1] += p.started
        row[2] += 0 if p.started else p.uncached
    return out


def test_peer_load_totals_are_kept_as_placements_change_not_walked_per_ranking():
    """`pending()` is read for every ranking: walking every peer placement there cost 7 ms a request at 60k
    peer requests in flight. Its totals follow every kind of message exactly, whatever their order."""
    import random

    from kvmesh.cluster.index import PrefixIndex

    index = PrefixIndex(max_blocks=100_000)
    for r in ("r0", "r1", "r2"):
        index.add_replica(r)
    now = [1000.0]
    peers = PeerPlacements(index, lambda: [])
    peers.monotonic = lambda: now[0]
    peers.placements = _CountedPlacements()
    rng = random.Random(7)
    for step in range(3000):
        router, request = rng.choice("AB"), f"q{rng.randrange(60)}"
        replica = rng.choice(("r0", "r1", "r2"))
        kind = rng.choice(("routed", "routed", "started", "done", "unrouted", "live", "expire", "forget", "bye"))
        if kind == "routed":
            n = rng.randrange(1, 5)
            info = RequestInfo(
                block_hashes=list(range(step, step + n)), num_tokens=32 * n, block_size=32, request_id=request
            )
            peers.apply(routed_message(router, info, replica, (0, 0, rng.randrange(n + 1))))
        elif kind == "live":
            peers.apply(["live", router, "", "", [request]])
        elif kind == "expire":
            now[0] += rng.choice((1.0, 60.0))
            peers.expire()
        elif kind == "forget":
            if rng.random() < 0.05:
                peers.forget_replica(replica)
        elif kind == "bye":
            if rng.random() < 0.05:
                peers.apply(["bye", router, "", ""])
        else:
            peers.apply([kind, router, request, replica])
        walks = _CountedPlacements.walks
        assert peers.pending() == _recount(peers), (step, kind)
        assert _CountedPlacements.walks == walks  # read without walking the placements
    assert peers.pending() == _recount(peers)
