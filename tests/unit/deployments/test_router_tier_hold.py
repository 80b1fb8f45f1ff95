"""Holding a request for a prefix another replica is computing, so that it loads it from LMCache instead of
computing it again: which in-flight request it can load from, what the tiers leave loadable, and the
router's wait (released by the first token, bounded by a timeout, skipped when not worth it)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from router_fakes import fake_request, make_router

from kvmesh.cluster.index import PrefixIndex
from kvmesh.cluster.kv_events import AllBlocksCleared
from kvmesh.cluster.tier_tracker import TierTracker
from kvmesh.deployments import local_state, miss_attribution
from kvmesh.deployments.prediction import PredictionLedger
from kvmesh.deployments.tier_hold import PrefillPace, common_blocks, loadable_prefixes, loadable_source
from kvmesh.kvstore.hashing import block_hashes


def fake_replica(rid: str, node_id: str):
    return SimpleNamespace(
        replica_id=SimpleNamespace(unique_id=rid),
        routing_stats={"node_id": node_id},
        node_id=node_id,
        max_ongoing_requests=64,
    )


def chain(*blocks):
    """Chained ids the way vLLM's block hashes are: each names its whole prefix."""
    return [tuple(blocks[: k + 1]) for k in range(len(blocks))]


def test_common_blocks_of_chained_hashes():
    assert common_blocks(chain(1, 2, 3, 4), chain(1, 2, 3, 9, 9)) == 3
    assert common_blocks(chain(1, 2), chain(1, 2, 3)) == 2
    assert common_blocks(chain(5), chain(1, 2)) == 0
    assert common_blocks([], chain(1)) == 0


def tracker(chunk_blocks=1):
    index = PrefixIndex(max_blocks=1000)
    index.add_replica("A", "n0")
    index.add_replica("A2", "n0")
    index.add_replica("B", "n1")
    index.add_replica("C", "n2")
    t = TierTracker(index)
    t.set_node("n0", has_shared_tier=True, host_capacity_blocks=100, chunk_blocks=chunk_blocks)
    t.set_node("n1", has_shared_tier=True, host_capacity_blocks=100, chunk_blocks=chunk_blocks)
    return t


def test_what_a_prefill_leaves_loadable_where():
    t = tracker(chunk_blocks=2)
    assert t.stored_prefix("A", "A2", 7) == 6  # one node's host tier, whole chunks only
    assert t.stored_prefix("A", "B", 7) == 6  # through the shared tier
    assert t.stored_prefix("A", "C", 7) == 0  # n2 runs no LMCache server
    t.set_shared_up(False)
    assert t.stored_prefix("A", "B", 7) == 0 and t.stored_prefix("A", "A2", 7) == 6


def test_the_in_flight_request_leaving_the_most_loadable_is_chosen():
    t = tracker()
    me = chain(1, 2, 3, 4, 5, 6)
    flights = [
        SimpleNamespace(replica="A", info=SimpleNamespace(block_hashes=chain(1, 2, 3), request_id="x")),
        SimpleNamespace(replica="A2", info=SimpleNamespace(block_hashes=chain(1, 2, 3, 4, 5, 9), request_id="y")),
        SimpleNamespace(replica="B", info=SimpleNamespace(block_hashes=chain(1, 2, 3, 4, 5, 6), request_id="z")),
        SimpleNamespace(replica="C", info=SimpleNamespace(block_hashes=chain(1, 2, 3, 4, 5, 6), request_id="w")),
    ]
    assert loadable_source(me, "me", "C", 0, flights, t) is None  # C's node runs no LMCache: nothing loads
    src, blocks = loadable_source(me, "me", "B", 0, flights, t)  # B's own flight is in its hbm already
    assert src.info.request_id == "y" and blocks == 5
    assert loadable_source(me, "me", "B", 5, flights, t) is None  # B already serves 5 blocks
    assert loadable_source(me, "y", "B", 0, flights[1:2], t) is None  # never the request itself


def test_a_prompt_in_flight_shared_up_to_inside_a_chunk_leaves_the_chunks_before_loadable():
    # LMCache keys a chunk by every token up to its end: sharing 5 blocks of a 6-block prompt in chunks of
    # 2 leaves 4 loadable, not 5
    t = tracker(chunk_blocks=2)
    me = chain(1, 2, 3, 4, 5, 7, 8)
    flights = [SimpleNamespace(replica="A", info=SimpleNamespace(block_hashes=chain(1, 2, 3, 4, 5, 6), request_id="x"))]
    src, blocks = loadable_source(me, "me", "B", 0, flights, t)
    assert src.info.request_id == "x" and blocks == 4
    assert loadable_source(me, "me", "B", 4, flights, t) is None  # B serves those 4 already


def test_what_every_replica_could_load_once_the_prefills_in_flight_are_stored():
    t = tracker()
    me = chain(1, 2, 3, 4, 5, 6)

    def flight(replica, blocks, rid, first_token=False):
        info = SimpleNamespace(block_hashes=chain(*blocks), request_id=rid)
        return SimpleNamespace(replica=replica, info=info, first_token=first_token, prefill_left_s=lambda: 0.25)

    flights = [flight("A2", (1, 2, 3, 4, 5, 9), "y"), flight("B", (1, 2, 3, 4, 5, 6), "z")]
    replicas = ["A", "A2", "B", "C"]
    got = loadable_prefixes(me, "me", replicas, [0, 5, 6, 0], flights, t)
    # A: z's six blocks through the shared tier; A2: z's too; B holds its own; C's node runs no LMCache
    assert got == ([6, 6, 6, 0], 0.25)
    assert loadable_prefixes(me, "me", replicas, [6, 6, 6, 0], flights, t) == (None, 0.0)  # nobody gains
    assert loadable_prefixes(me, "z", replicas, [0, 0, 0, 0], flights[1:], t) == (None, 0.0)  # not itself
    flights[1].first_token = True  # its prefill is over: loadable now
    assert loadable_prefixes(me, "me", replicas, [0, 0, 6, 0], flights, t) == ([6, 6, 6, 0], 0.0)


class _Stub:
    """Places p1 on A and everything else on B first; the wait is worth it when `worth`."""

    name = "stub"
    uses_index = True

    def __init__(self, worth: bool):
        self.worth, self.asked, self.inflight = worth, [], {}

    def place(self, request, fleet):
        got = fleet.inflight_blocks
        self.inflight[request.request_id] = (
            None if got is None else dict(zip(fleet.ids, got.tolist())),
            fleet.inflight_ready_s,
        )
        first = fleet.ids.index("A" if request.request_id == "p1" else "B")
        return [first] + [k for k in range(len(fleet.ids)) if k != first]

    def predict(self, request, view):
        return 0.05, request.num_tokens

    def hold_worth(self, missing_tokens, extra_wait_s):
        self.asked.append(missing_tokens)
        return self.worth

    def on_routed(self, *a, **k):
        pass

    def on_unrouted(self, *a, **k):
        pass

    def on_replica_added(self, rid):
        pass

    def on_replica_removed(self, rid):
        pass


PROMPT = [(i * 7919) % 1000 + 10 for i in range(320)]  # 10 blocks of 32


async def lmcache_router(worth: bool = True, limit_s: float = 10.0, chunk_blocks: int = 1):
    """A router over replica A (node n0) and B (node n1), both nodes on LMCache with the shared tier (chunks
    of `chunk_blocks` engine blocks), ranking with `_Stub(worth)`. Returns (router, a, b)."""
    router = make_router(policy="kvmesh", block_size=32)
    router.policy = stub = _Stub(worth)
    router._policies = {"kvmesh": stub}
    router.hold_limit_s = limit_s
    a, b = fake_replica("A", node_id="n0"), fake_replica("B", node_id="n1")
    await router.choose_replicas([a, b], fake_request([1, 2, 3], "reg"))
    for node in ("n0", "n1"):
        router.tiers.set_node(node, has_shared_tier=True, host_capacity_blocks=1000, chunk_blocks=chunk_blocks)
    return router, a, b


def hold_scenario(monkeypatch, worth: bool, first_token: bool, limit_s: float = 10.0):
    """p1 is computing a 320-token prompt on A (node n0); p2 shares it and is ranked onto B (node n1), both
    nodes on the shared tier. Returns (p2 still waiting after 0.2 s, the ranking, p2's prediction, router)."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router, a, b = await lmcache_router(worth, limit_s)
        prompt = PROMPT
        p1 = fake_request(prompt, "p1")
        assert (await router.choose_replicas([a, b], p1))[0][0] is a
        router._routed(p1, a.replica_id)
        p2 = fake_request(prompt + [11, 12, 13], "p2")
        task = asyncio.create_task(router.choose_replicas([a, b], p2))
        await asyncio.sleep(0.2)
        waiting = not task.done()
        if first_token:
            router.first_token("p1")
        ranked = await asyncio.wait_for(task, 5)
        router._routed(p2, ranked[0][0].replica_id)
        return waiting, ranked, local_state.LEDGER.prediction("p2"), router

    return asyncio.run(scenario())


def test_a_request_waits_for_the_computing_requests_first_token_then_loads_the_prefix(monkeypatch):
    waiting, ranked, predicted, router = hold_scenario(monkeypatch, worth=True, first_token=True)
    assert waiting  # held until p1's first token
    assert ranked[0][0].replica_id.unique_id == "B"
    assert predicted == 320  # the 10 blocks p1 stored, as LMCache reports them (all but the last token)
    assert router.held_for_tier == 1 and router.hold_timeouts == 0
    assert router.policy.asked == [320]
    assert router.snapshot()["held_for_tier"] == 1
    # ranked knowing B could load p1's 10 blocks once p1's prefill (predicted 0.05 s) is stored
    blocks, ready_s = router.policy.inflight["p2"]
    assert blocks == {"A": 10, "B": 10} and 0.0 < ready_s <= 0.05
    assert router.policy.inflight["p1"] == (None, 0.0)  # nothing in flight when p1 was ranked


def test_a_held_request_is_committed_while_it_waits_and_its_prefix_speculated_once_it_is_sent(monkeypatch):
    """Requests ranked while p2 waits for p1's prefill must see p2's work credited to B: committed only once
    the hold ended, a group's members held for the same new prompt all see the same idle replica and all go
    there. Its prefix goes into the index only when the hold ends: B does not have it before p2 is sent, and
    a request sent there meanwhile for that prefix would compute it."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router, a, b = await lmcache_router()
        routed = []
        router.policy.on_routed = lambda info, rid, view=None: routed.append((info.request_id, rid, view))
        p1 = fake_request(PROMPT, "p1")
        await router.choose_replicas([a, b], p1)
        router._routed(p1, a.replica_id)
        p2_ids = PROMPT + [11, 12, 13] + list(range(500, 529))
        task = asyncio.create_task(router.choose_replicas([a, b], fake_request(p2_ids, "p2")))
        await asyncio.sleep(0.2)
        on_b = lambda: router.index.match(block_hashes(p2_ids, 32)).get("B", (0, 0, 0))[0]  # noqa: E731
        during = (not task.done(), list(routed), on_b())
        router.first_token("p1")
        ranked = await asyncio.wait_for(task, 5)
        return during, ranked, routed, on_b()

    (waiting, routed_during, on_b_during), ranked, routed, on_b_after = asyncio.run(scenario())
    assert waiting and ranked[0][0].replica_id.unique_id == "B"
    assert [(r, rid) for r, rid, _ in routed_during] == [("p1", "A"), ("p2", "B")]
    assert routed_during[1][2].shared_blocks == 10  # credited as loading p1's 10 blocks, not computing them
    assert on_b_during == 0 and on_b_after == 11  # p2's own 11 full blocks speculated on B once it is sent
    assert len(routed) == 2  # committed once: the hold ended as planned


def test_a_request_may_wait_for_the_prefill_of_a_request_that_is_itself_held(monkeypatch):
    """p2 (p1's prompt and a document) is held on B for p1's prompt; p3, sharing prompt and document, is
    ranked onto C meanwhile. p2 will compute the document itself: p3 waits for p2's first token, not only
    for p1's, and loads both. Without p2 as a source p3 would load the prompt and compute the document again."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())
    doc = [(i * 104729) % 997 + 3 for i in range(128)]  # 4 more blocks

    async def scenario():
        router, a, b = await lmcache_router()
        c = fake_replica("C", node_id="n1")
        await router.choose_replicas([a, b, c], fake_request([4, 5, 6], "reg2"))
        where = {"p1": "A", "p2": "B", "p3": "C"}

        def place(request, fleet):
            first = fleet.ids.index(where[request.request_id])
            return [first] + [k for k in range(len(fleet.ids)) if k != first]

        router.policy.place = place
        p1, p2, p3 = (
            fake_request(ids, rid) for ids, rid in ((PROMPT, "p1"), (PROMPT + doc, "p2"), (PROMPT + doc + [9], "p3"))
        )
        await router.choose_replicas([a, b, c], p1)
        router._routed(p1, a.replica_id)
        t2 = asyncio.create_task(router.choose_replicas([a, b, c], p2))
        await asyncio.sleep(0.1)
        t3 = asyncio.create_task(router.choose_replicas([a, b, c], p3))
        await asyncio.sleep(0.1)
        held = sorted(st.info.request_id for st in router._held.values())
        router.first_token("p1")
        ranked2 = await asyncio.wait_for(t2, 5)
        router._routed(p2, ranked2[0][0].replica_id)
        await asyncio.sleep(0.1)
        p3_waiting = not t3.done()
        router.first_token("p2")
        ranked3 = await asyncio.wait_for(t3, 5)
        router._routed(p3, ranked3[0][0].replica_id)
        return held, p3_waiting, router

    held, p3_waiting, router = asyncio.run(scenario())
    assert held == ["p2", "p3"]  # both held at once: p2 for p1, p3 for p2
    assert p3_waiting  # p1's first token did not release p3: it waits for p2, which computes the document
    assert local_state.LEDGER.prediction("p2") == 320 and local_state.LEDGER.prediction("p3") == 448
    assert router.held_for_tier == 2 and router.hold_timeouts == 0 and not router._held


def test_a_hold_that_runs_out_commits_the_request_again_without_the_prefix(monkeypatch):
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router, a, b = await lmcache_router(limit_s=0.3)
        routed, unrouted = [], []
        router.policy.on_routed = lambda info, rid, view=None: routed.append((info.request_id, rid, view))
        router.policy.on_unrouted = lambda info, rid: unrouted.append((info.request_id, rid))
        p1 = fake_request(PROMPT, "p1")
        await router.choose_replicas([a, b], p1)
        router._routed(p1, a.replica_id)
        p2 = fake_request(PROMPT + [11], "p2")
        ranked = await asyncio.wait_for(router.choose_replicas([a, b], p2), 5)
        router._routed(p2, ranked[0][0].replica_id)
        return routed, unrouted, local_state.LEDGER.prediction("p2"), router

    routed, unrouted, predicted, router = asyncio.run(scenario())
    assert router.hold_timeouts == 1 and unrouted == [("p2", "B")]
    assert [(r, rid, v.shared_blocks) for r, rid, v in routed[1:]] == [("p2", "B", 10), ("p2", "B", 0)]
    assert predicted == 0  # computed on B after all


def test_the_prediction_counts_the_tier_in_whole_lmcache_chunks(monkeypatch):
    """p1's prompt (10 blocks) was computed on A and stored in chunks of 2 blocks; p2 shares its first 5
    blocks and goes to B, which can load only the 2 chunks before the point where the prompts part (a
    chunk is keyed by every token up to its end): 128 cached tokens, not 160."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router, a, b = await lmcache_router(chunk_blocks=2)
        p1 = fake_request(PROMPT, "p1")
        await router.choose_replicas([a, b], p1)
        router._routed(p1, a.replica_id)
        router.first_token("p1")
        router.on_request_completed(a.replica_id, "i-p1")  # its prefill is in the tiers now
        p2 = fake_request(PROMPT[:160] + [7] * 100, "p2")
        ranked = await asyncio.wait_for(router.choose_replicas([a, b], p2), 5)
        router._routed(p2, ranked[0][0].replica_id)
        return ranked, router

    ranked, router = asyncio.run(scenario())
    assert ranked[0][0].replica_id.unique_id == "B"
    assert router.tiers.counters["prefills_recorded"] == 1
    assert local_state.LEDGER.prediction("p2") == 128
    assert router.recent_decisions()[-1]["chosen_tiers"] == [0, 0, 4]


def test_the_blocks_past_the_last_whole_chunk_miss_as_partial_chunk_not_evicted(monkeypatch):
    """The same p2 once A's engine has dropped p1 from its own cache, delivered the 128 tokens predicted: of
    the 5 blocks it shares with p1, the 5th was in the tiers but in a chunk p2 leaves midway. The miss
    attribution says so (`partial_chunk`): it was neither evicted nor elsewhere."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())
    monkeypatch.setattr(miss_attribution, "ATTRIBUTION", miss_attribution.MissAttribution())
    p2_ids = PROMPT[:160] + [7] * 100

    att = miss_attribution.ATTRIBUTION

    async def scenario():
        router, a, b = await lmcache_router(chunk_blocks=2)
        p1 = fake_request(PROMPT, "p1")
        p1.args[0]["tenant"] = "t"
        await router.choose_replicas([a, b], p1)
        router._routed(p1, a.replica_id)
        router.first_token("p1")
        att.delivered("p1", "t", PROMPT, 0)  # the ingress, at p1's first token
        router.on_request_completed(a.replica_id, "i-p1")
        router.tiers.apply_events("A", [AllBlocksCleared()])  # A's engine cache: empty again
        p2 = fake_request(p2_ids, "p2")
        p2.args[0]["tenant"] = "t"
        ranked = await asyncio.wait_for(router.choose_replicas([a, b], p2), 5)
        router._routed(p2, ranked[0][0].replica_id)

    asyncio.run(scenario())
    reasons = att.delivered("p2", "t", p2_ids, 128)
    assert att.explain("p2")["seen_at_placement"] == 5  # p1's prompt, computed before p2 was placed
    assert att.explain("p2")["tier_blocks"] == 5 and att.explain("p2")["elsewhere_blocks"] == 4  # A's host tier
    assert reasons == {"partial_chunk": 32, "cold": 96, "partial_block": 4}


def test_no_wait_when_the_policy_finds_it_not_worth_it(monkeypatch):
    waiting, ranked, predicted, router = hold_scenario(monkeypatch, worth=False, first_token=False)
    assert not waiting and ranked[0][0].replica_id.unique_id == "B"
    assert predicted == 0 and router.held_for_tier == 0


def test_a_hold_runs_out_when_the_first_token_never_comes(monkeypatch):
    waiting, ranked, predicted, router = hold_scenario(monkeypatch, worth=True, first_token=False, limit_s=0.5)
    assert waiting and ranked[0][0].replica_id.unique_id == "B"
    assert predicted == 0  # not stored: computed again
    assert router.held_for_tier == 1 and router.hold_timeouts == 1


def test_the_prefill_pace_is_a_running_mean_of_actual_over_predicted_never_below_one():
    pace = PrefillPace()
    assert pace.value == 1.0
    pace.observe(0.5, 0.05)  # ten times as long as predicted
    assert pace.value == 10.0
    pace.observe(0.05, 0.05)
    assert abs(pace.value - (10.0 + 0.1 * (1.0 - 10.0))) < 1e-12
    pace.observe(1.0, 0.0)  # nothing predicted: no ratio
    assert abs(pace.value - 9.1) < 1e-12
    faster = PrefillPace()
    faster.observe(0.01, 0.05)
    assert faster.value == 1.0  # faster than predicted never shortens the limit


def test_a_hold_lasts_as_long_as_first_tokens_have_been_coming_slower_than_predicted(monkeypatch):
    """p1's first token comes 0.8 s after p2's hold began; p1's prefill is predicted at 0.05 s, so the hold's
    limit is 0.6 s at the predicted pace. p0, another request in flight, shows how slow the machine is: its
    first token on time leaves the limit there (the hold runs out, p2 computes the prefix again); the router
    having seen first tokens come ten times as late as predicted puts it at about 1.5 s; p0's first token
    coming back late during the hold (0.3 s against 0.05 predicted) moves it out, and so does p0 still waiting
    for its first token when the limit passes (late already, with nothing back yet)."""

    def scenario(pace: float = 1.0, p0_first_token_at: float | None = 0.05):
        monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

        async def run():
            router, a, b = await lmcache_router()
            if pace > 1.0:
                router.prefill_pace.observe(pace * 0.05, 0.05)
            p0 = fake_request([5] * 64, "p0")  # another prompt, in flight on B
            await router.choose_replicas([a, b], p0)
            router._routed(p0, b.replica_id)
            p1 = fake_request(PROMPT, "p1")
            await router.choose_replicas([a, b], p1)
            router._routed(p1, a.replica_id)
            p2 = fake_request(PROMPT + [11], "p2")
            task = asyncio.create_task(router.choose_replicas([a, b], p2))
            if p0_first_token_at is not None:
                await asyncio.sleep(p0_first_token_at)
                router.first_token("p0")
            await asyncio.sleep(0.8 - (p0_first_token_at or 0.0))
            router.first_token("p1")
            ranked = await asyncio.wait_for(task, 5)
            router._routed(p2, ranked[0][0].replica_id)
            return router, local_state.LEDGER.prediction("p2")

        return asyncio.run(run())

    router, predicted = scenario()
    assert router.hold_timeouts == 1 and predicted == 0  # ran out at 0.6 s: computed again
    router, predicted = scenario(pace=10.0)
    assert router.held_for_tier == 1 and router.hold_timeouts == 0 and predicted == 320  # loaded
    # the running mean: p0's first token on time took it to about 9.1, p1's, 0.8 s after its placement against
    # 0.05 s predicted, back up to about 9.8
    assert 9.5 < router.prefill_pace.value < 10.0 and router.snapshot()["prefill_pace"] == router.prefill_pace.value
    for late in (0.3, None):
        router, predicted = scenario(p0_first_token_at=late)
        assert router.held_for_tier == 1 and router.hold_timeouts == 0 and predicted == 320, late


def test_the_pace_of_requests_still_waiting_is_the_lower_median_of_how_late_each_already_is():
    from kvmesh.deployments.tier_hold import pace_of_waiting

    assert pace_of_waiting([]) == 0.0 and pace_of_waiting([(1.0, 0.0)]) == 0.0
    assert pace_of_waiting([(0.6, 0.5), (0.1, 0.5), (30.0, 0.5)]) == 1.2  # one stuck request moves nothing
    assert pace_of_waiting([(0.1, 0.5), (30.0, 0.5)]) == 0.2


def test_no_hold_without_lmcache_on_the_nodes(monkeypatch):
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        router.policy = _Stub(True)
        router._policies = {"kvmesh": router.policy}
        a, b = fake_replica("A", node_id="n0"), fake_replica("B", node_id="n1")
        await router.choose_replicas([a, b], fake_request([1, 2, 3], "reg"))
        prompt = list(range(100, 420))
        p1 = fake_request(prompt, "p1")
        await router.choose_replicas([a, b], p1)
        router._routed(p1, a.replica_id)
        ranked = await asyncio.wait_for(router.choose_replicas([a, b], fake_request(prompt + [1], "p2")), 1)
        return ranked, router

    ranked, router = asyncio.run(scenario())
    assert ranked[0][0].replica_id.unique_id == "B" and router.held_for_tier == 0
    assert router.index.match(block_hashes(list(range(100, 420)), 32))["A"][0] == 10  # p1's prefix is on A


def peer_hold_scenario(monkeypatch, messages: tuple[str, ...], limit_s: float = 10.0):
    """As `hold_scenario`, but p1 was placed on A by another ingress replica's router: this router knows it
    only from the placement stream, which then brings `messages` about p1. Returns (p2 still waiting after
    0.2 s, the ranking, p2's prediction, router)."""
    from kvmesh.deployments.router_sync import routed_message
    from kvmesh.policies.base import RequestInfo

    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router, a, b = await lmcache_router(True, limit_s)
        prompt = PROMPT
        p1 = RequestInfo(block_hashes=block_hashes(prompt, 32), num_tokens=320, block_size=32, request_id="p1")
        router.peers.apply(routed_message("peer", p1, "A", (0, 0, 0)))
        task = asyncio.create_task(router.choose_replicas([a, b], fake_request(prompt + [11, 12, 13], "p2")))
        await asyncio.sleep(0.2)
        waiting = not task.done()
        for kind in messages:
            router.peers.apply([kind, "peer", "p1", "A"])
        ranked = await asyncio.wait_for(task, 5)
        router._routed(fake_request(prompt + [11, 12, 13], "p2"), ranked[0][0].replica_id)
        return waiting, ranked, local_state.LEDGER.prediction("p2"), router

    return asyncio.run(scenario())


def test_a_request_waits_for_a_prefix_another_ingress_replica_is_computing(monkeypatch):
    waiting, ranked, predicted, router = peer_hold_scenario(monkeypatch, ("started",))
    assert waiting  # held until the peer router's word that p1's first token is back
    assert ranked[0][0].replica_id.unique_id == "B"
    assert predicted == 320
    assert router.held_for_tier == 1 and router.hold_timeouts == 0


def test_a_unary_peer_request_confirmed_after_its_completion_still_counts(monkeypatch):
    # a unary request's router learns of its first token from the whole response, after Serve's completion
    waiting, ranked, predicted, router = peer_hold_scenario(monkeypatch, ("done", "started"))
    assert waiting and ranked[0][0].replica_id.unique_id == "B"
    assert predicted == 320 and router.hold_timeouts == 0


def test_a_peer_that_leaves_releases_its_waiters_without_credit(monkeypatch):
    waiting, ranked, predicted, router = peer_hold_scenario(monkeypatch, ("done", "bye"))
    assert waiting and ranked[0][0].replica_id.unique_id == "B"
    assert predicted == 0 and router.hold_timeouts == 0  # released at once by "bye", not by the timeout


def test_a_peer_request_that_never_starts_holds_its_waiters_only_until_the_timeout(monkeypatch):
    waiting, ranked, predicted, router = peer_hold_scenario(monkeypatch, ("done",), limit_s=0.5)
    assert waiting and ranked[0][0].replica_id.unique_id == "B"
    assert predicted == 0 and router.hold_timeouts == 1


def test_an_own_unary_request_confirmed_after_its_completion_still_counts(monkeypatch):
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router, a, b = await lmcache_router()
        prompt = PROMPT
        p1 = fake_request(prompt, "p1")
        await router.choose_replicas([a, b], p1)
        router._routed(p1, a.replica_id)
        task = asyncio.create_task(router.choose_replicas([a, b], fake_request(prompt + [11], "p2")))
        await asyncio.sleep(0.2)
        router.on_request_completed(a.replica_id, "i-p1")  # Serve's completion first
        await asyncio.sleep(0.1)
        still_waiting = not task.done()
        router.first_token("p1")  # then the ingress's word
        ranked = await asyncio.wait_for(task, 5)
        router._routed(fake_request(prompt + [11], "p2"), ranked[0][0].replica_id)
        return still_waiting, local_state.LEDGER.prediction("p2"), router

    still_waiting, predicted, router = asyncio.run(scenario())
    assert still_waiting  # the completion alone does not release it: its prefill is not known to have run
    assert predicted == 320 and router.hold_timeouts == 0
    assert router.tiers.counters["prefills_recorded"] == 1


def test_a_peer_request_completed_after_its_first_token_counts_in_the_lmcache_tiers():
    from kvmesh.deployments.router_sync import PeerPlacements, routed_message
    from kvmesh.policies.base import RequestInfo

    t = tracker()
    peers = PeerPlacements(t.index, lambda: [], tiers=t)
    hashes = block_hashes(list(range(200, 520)), 32)
    for q, kinds in (("q1", ("started", "done")), ("q2", ("done",))):
        info = RequestInfo(
            block_hashes=hashes if q == "q1" else hashes[:1] + [7, 8], num_tokens=320, block_size=32, request_id=q
        )
        peers.apply(routed_message("peer", info, "A", (0, 0, 0)))
        for kind in kinds:
            peers.apply([kind, "peer", q, "A"])
    match = t.index.match(hashes)
    assert match["A2"][1] == 10  # q1: on A's node's host tier
    assert match["B"][2] == 10  # and in the shared tier, which B's node reads
    assert t.index.match(hashes[:1] + [7, 8])["B"][2] == 1  # q2 never started: only q1's block 1 is stored


def test_a_hold_gives_up_when_the_pace_grows_slower_than_the_clock_instead_of_spinning():
    """The pace of requests still waiting grows with the clock itself (each is later by the second): a
    deadline it moves by less than the clock passes is one the wait must give up at, not retry at once
    on the router's loop until the source comes back."""
    import time

    from kvmesh.deployments.router_hold import TierHolding

    class Source:
        first_token = False

        def __init__(self):
            self.routed_at = time.monotonic()
            self.event = asyncio.Event()

        def released(self):
            return self.event

        def prefill_end_s(self, pace: float = 1.0) -> float:
            return self.routed_at + pace * 0.02  # 20 ms of prefill predicted

    class Holding(TierHolding):
        def __init__(self):
            self._init_holds()
            self.started = time.monotonic()
            self.paces = 0

        def _pace(self, src) -> float:  # three requests predicted at 1 s, 2 s late when the hold began
            self.paces += 1
            return max(1.0, (2.0 + time.monotonic() - self.started) / 1.0)

    async def run():
        holding, src = Holding(), Source()

        async def release_later():
            await asyncio.sleep(0.9)
            src.first_token = True
            src.event.set()

        releaser = asyncio.create_task(release_later())
        t0 = time.monotonic()
        stored = await holding._wait_for_source(src)
        waited = time.monotonic() - t0
        releaser.cancel()
        return stored, waited, holding

    stored, waited, holding = asyncio.run(run())
    assert not stored and holding.hold_timeouts == 1
    assert waited < 0.85 and holding.paces < 20


class _Wire:
    """Stands in for RouterSync: collects what the router publishes."""

    router_id = "A"

    def __init__(self):
        self.sent: list[list] = []

    def publish(self, msg):
        self.sent.append(msg)

    def drain(self):
        return 0

    def stats(self):
        return {}


def _tenant_request(ids, request_id):
    pending = fake_request(ids, request_id)
    pending.args[0]["tenant"] = "acme"
    return pending


def _peer_hearing(router):
    """Another ingress replica's view of `router`'s placement stream: (its PeerPlacements, relay)."""
    from kvmesh.deployments.router_sync import PeerPlacements

    index = PrefixIndex(max_blocks=1000)
    index.add_replica("A", "n0")
    index.add_replica("B", "n1")
    peers = PeerPlacements(index, lambda: [])

    def relay():
        for msg in router.sync.sent:
            peers.apply(msg)
        router.sync.sent.clear()

    return peers, relay


def test_requests_held_for_a_prefix_count_for_their_tenant_on_peers_from_their_commit(monkeypatch):
    """A tenant's requests its router holds for a prefix in flight (up to hold_limit_s) are admitted: the other
    ingress replicas count them towards the tenant's fleet-wide max_concurrent from the commit, not from the
    hold's end, or the tenant runs past its limit meanwhile (4 allowed, 7 ran). Held, they credit no replica
    and no prefix there; sent, they count once in flight and once in the log of placed requests."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router, a, b = await lmcache_router()
        router.hold_task_share = 1.0  # three held at once: more than the bound on two replicas (`_may_hold`)
        router.sync = _Wire()
        peers, relay = _peer_hearing(router)
        p1 = _tenant_request(PROMPT, "p1")
        await router.choose_replicas([a, b], p1)
        router._routed(p1, a.replica_id)
        held = {f"p{k}": _tenant_request(PROMPT + [11, 12, k], f"p{k}") for k in (2, 3, 4)}
        tasks = {rid: asyncio.create_task(router.choose_replicas([a, b], p)) for rid, p in held.items()}
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in tasks.values())
        relay()
        during = (peers.tenants.active("acme"), len(peers.tenants.since("acme", 0)[1]), peers.pending())
        on_b = peers.index.match(block_hashes(PROMPT, 32))["B"]
        router.first_token("p1")
        for rid, task in tasks.items():
            router._routed(held[rid], (await asyncio.wait_for(task, 5))[0][0].replica_id)
        relay()
        sent = (peers.tenants.active("acme"), len(peers.tenants.since("acme", 0)[1]), set(peers.placements))
        for rid, where in (("p1", a), ("p2", b), ("p3", b), ("p4", b)):
            router.on_request_completed(where.replica_id, "i-" + rid)
        relay()
        return during, on_b, sent, peers.tenants.active("acme")

    during, on_b, sent, after = asyncio.run(scenario())
    assert during == (4, 4, {"A": [1, 0, 320]})  # p1 on A; the 3 held count for acme, on no replica
    assert on_b == (0, 0, 0)  # no prefix speculated for the held requests
    assert sent == (4, 4, {("A", f"p{k}") for k in (1, 2, 3, 4)})
    assert after == 0


def test_a_held_request_cancelled_or_run_out_or_whose_router_left_is_released_on_peers_once(monkeypatch):
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router, a, b = await lmcache_router(limit_s=0.3)
        router.sync = _Wire()
        peers, relay = _peer_hearing(router)
        p1 = _tenant_request(PROMPT, "p1")
        await router.choose_replicas([a, b], p1)
        router._routed(p1, a.replica_id)
        counts = []
        # cancelled while held: Serve cancels the request's future (its client left) and the ranking
        gone = _tenant_request(PROMPT + [11], "gone")
        gone.future = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(router.choose_replicas([a, b], gone))
        await asyncio.sleep(0.1)
        relay()
        counts.append(peers.tenants.active("acme"))
        gone.future.cancel()
        task.cancel()
        await asyncio.sleep(0)
        relay()
        counts.append(peers.tenants.active("acme"))
        # the hold runs out (p1's first token never comes): committed again and sent, the claim taken over
        late = _tenant_request(PROMPT + [12], "late")
        ranked = await asyncio.wait_for(router.choose_replicas([a, b], late), 5)
        kinds = [m[0] for m in router.sync.sent if m[2] == "late"]
        relay()
        router._routed(late, ranked[0][0].replica_id)
        counts.append(peers.tenants.active("acme"))
        # a request still held when its router leaves
        task = asyncio.create_task(router.choose_replicas([a, b], _tenant_request(PROMPT + [13], "left")))
        await asyncio.sleep(0.05)
        relay()
        counts.append(peers.tenants.active("acme"))
        peers.apply(["bye", "A", "", ""])
        counts.append(peers.tenants.active("acme"))
        await asyncio.wait_for(task, 5)
        return counts, kinds, router.hold_timeouts, len(peers.tenants.since("acme", 0)[1])

    counts, kinds, timeouts, logged = asyncio.run(scenario())
    assert counts == [2, 1, 2, 3, 0]
    assert kinds == ["held", "routed"] and timeouts == 1  # no `unrouted` between: the count never dips
    assert logged == 4  # p1, gone, late, left: once each


# --- a source on a suspect replica (its node froze: replica_watch) ---------------------------------------


def test_no_request_is_held_for_a_prefill_on_a_suspect_replica():
    """p1 computes the prompt on A, whose node then froze (A suspect): its first token may never come, so p2,
    ranked onto B, is not held for it (before: held to the hold limit)."""

    async def scenario():
        router, a, b = await lmcache_router(worth=True, limit_s=2.0)
        p1 = fake_request(PROMPT, "p1")
        assert (await router.choose_replicas([a, b], p1))[0][0] is a
        router._routed(p1, a.replica_id)
        router.watch.suspect.add("A")  # as two missed probes leave it
        t0 = asyncio.get_running_loop().time()
        await router.choose_replicas([a, b], fake_request(PROMPT + [11, 12, 13], "p2"))
        return asyncio.get_running_loop().time() - t0, router.held_for_tier

    took, held = asyncio.run(scenario())
    assert took < 0.5 and held == 0, (took, held)


def test_a_replica_that_became_suspect_during_a_hold_is_not_handed_to_serve():
    """p2 is held (ranked onto B) for p1's prefill on A; B's node freezes meanwhile: when the hold ends, the
    ranking Serve gets leaves B out (Serve would send there blind while its queue length is cached)."""

    async def scenario():
        router, a, b = await lmcache_router(worth=True, limit_s=10.0)
        p1 = fake_request(PROMPT, "p1")
        await router.choose_replicas([a, b], p1)
        router._routed(p1, a.replica_id)
        task = asyncio.create_task(router.choose_replicas([a, b], fake_request(PROMPT + [11, 12, 13], "p2")))
        await asyncio.sleep(0.2)
        assert not task.done() and router.held_for_tier == 1
        router.watch.suspect.add("B")
        router.first_token("p1")
        return [g[0].replica_id.unique_id for g in await asyncio.wait_for(task, 5)]

    assert asyncio.run(scenario()) == ["A"]


# --- holds and Serve's routing tasks; replicas lost during a hold ----------------------------------------


class _ServeReplica:
    """A replica Serve's own routing loop can use: id, routing stats, a queue-length probe (always free)."""

    def __init__(self, rid: str, node_id: str):
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(unique_id=rid, deployment_id=DeploymentID(name="EngineReplica", app_name="t"))
        self.node_id = node_id
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.max_ongoing_requests = 64
        self.is_cross_language = False
        self.routing_stats = {"node_id": node_id}

    async def get_queue_len(self, *, deadline_s):
        await asyncio.sleep(0.001)
        return 0


def _serve_request(ids, request_id: str):
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    req = {"request_id": request_id, "prompt_token_ids": ids, "cache_salt": None, "params": {"max_tokens": 4}}
    meta = RequestMetadata(request_id=request_id, internal_request_id="i-" + request_id)
    return PendingRequest(args=[req], kwargs={}, metadata=meta)


class _SlowStub(_Stub):
    def predict(self, request, view):
        return 1.0, request.num_tokens  # a hold waits up to 2 x 1 s + 0.5 s for p1's first token


def test_requests_held_for_a_prefix_leave_serves_routing_tasks_to_the_others(monkeypatch):
    """A held request waits inside one of Serve's routing tasks (2 per replica: 4 here). With four of p1's
    group waiting for its prefill, an unrelated request on free replicas was not ranked until the holds ran out
    (2.4 s). Holds now take half the tasks at most; a request over that bound is placed at once, ranked and
    credited as one that is not held: it will compute the prefix, so its prediction counts none of it."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        import time

        router = make_router(policy="kvmesh", block_size=32)
        router.policy = stub = _SlowStub(True)
        router._policies = {"kvmesh": stub}
        a, b = _ServeReplica("A", "n0"), _ServeReplica("B", "n1")
        router.update_replicas([a, b])
        for node in ("n0", "n1"):
            router.tiers.set_node(node, has_shared_tier=True, host_capacity_blocks=1000, chunk_blocks=1)
        assert (await router._choose_replica_for_request(_serve_request(PROMPT, "p1"))).replica_id.unique_id == "A"
        await asyncio.sleep(0)
        group = [
            asyncio.create_task(router._choose_replica_for_request(_serve_request(PROMPT + [11, k], f"g{k}")))
            for k in range(4)
        ]
        await asyncio.sleep(0.1)
        held = sorted(st.info.request_id for st in router._held.values())
        t0 = time.perf_counter()
        other = await router._choose_replica_for_request(_serve_request([7] * 640, "unrelated"))
        waited = time.perf_counter() - t0
        placed = {f"g{k}": local_state.LEDGER.prediction(f"g{k}") for k in range(4)}
        offered = {f"g{k}": stub.inflight[f"g{k}"][0] for k in range(4)}
        for t in group:
            t.cancel()
        await asyncio.gather(*group, return_exceptions=True)
        return held, waited, other.replica_id.unique_id, placed, offered, router

    held, waited, other, placed, offered, router = asyncio.run(scenario())
    assert len(held) == 2 and router.max_num_routing_tasks == 4
    assert waited < 0.5 and other == "B" and router.hold_timeouts == 0
    assert held == ["g0", "g1"]
    # g0 and g1 still held: not sent yet. g2, sent at once, computes the prefix on B: no credit for it (credited
    # as if held, it would predict 320 cached tokens and get none); g3, sent after it, finds g2's blocks on B
    assert placed == {"g0": None, "g1": None, "g2": 0, "g3": 320}
    assert offered["g2"] is None  # nor ranked as if a hold were coming
    assert offered["g0"] == offered["g1"] == {"A": 10, "B": 10}


def test_a_hold_ends_at_once_when_its_replica_dies_and_serve_is_not_handed_a_dead_replica():
    """p2 is held on B for p1's prefill on A; B dies meanwhile (the ingress saw it fail a request). The hold
    ends at once, without waiting for p1 or the hold limit, and Serve gets no ranking naming B: asked again,
    the request is ranked over the replicas left."""

    async def scenario():
        router, a, b = await lmcache_router(worth=True, limit_s=10.0)
        p1 = fake_request(PROMPT, "p1")
        await router.choose_replicas([a, b], p1)
        router._routed(p1, a.replica_id)
        p2 = fake_request(PROMPT + [11, 12, 13], "p2")
        task = asyncio.create_task(router.choose_replicas([a, b], p2))
        await asyncio.sleep(0.1)
        assert not task.done() and router.held_for_tier == 1
        router.replica_failed("B")
        first = await asyncio.wait_for(task, 0.2)
        router.policy.place = lambda request, fleet: list(range(len(fleet.ids)))
        again = await router.choose_replicas([a, b], p2)  # Serve asks again
        return first, again, router

    first, again, router = asyncio.run(scenario())
    assert "B" not in [g[0].replica_id.unique_id for g in first]
    assert [g[0].replica_id.unique_id for g in again] == ["A"]
    assert router._routing["i-p2"].replica == "A" and router.hold_timeouts == 0


def test_a_replica_that_died_during_a_hold_is_not_handed_to_serve():
    """p2 is held on B for p1's prefill on A, with C ranked after them; C dies (its engine reports itself broken
    to a request ranked meanwhile). When p2's hold ends, B and A are handed to Serve, not C (a suspect replica
    was left out already; a dead one was not)."""

    async def scenario():
        router, a, b = await lmcache_router(worth=True, limit_s=10.0)
        c = fake_replica("C", node_id="n1")
        await router.choose_replicas([a, b, c], fake_request([4, 5, 6], "reg2"))
        p1 = fake_request(PROMPT, "p1")
        await router.choose_replicas([a, b, c], p1)
        router._routed(p1, a.replica_id)
        task = asyncio.create_task(router.choose_replicas([a, b, c], fake_request(PROMPT + [11, 12, 13], "p2")))
        await asyncio.sleep(0.1)
        assert not task.done() and router.held_for_tier == 1
        c.routing_stats = {"node_id": "n1", "healthy": False}
        await router.choose_replicas([a, b, c], fake_request([8, 9], "other"))
        router.first_token("p1")
        return [g[0].replica_id.unique_id for g in await asyncio.wait_for(task, 5)], router

    ranked, router = asyncio.run(scenario())
    assert ranked == ["B", "A"] and "C" in router._dead


class _Queued(_Stub):
    """`_Stub` whose predictions queue: p1's prefill takes 0.5 s, and a request waits 1e-4 s per prefill
    token pending on its replica before its own starts; a hold is worth an extra wait under 0.3 s."""

    def predict(self, request, view):
        return (0.5 if request.request_id == "p1" else 0.05) + view.pending_prefill_tokens * 1e-4, request.num_tokens

    def hold_worth(self, missing_tokens, extra_wait_s):
        self.asked.append(extra_wait_s)
        return extra_wait_s < 0.3


def queued_hold_scenario(
    monkeypatch, queued_tokens: int, pace: float = 1.0, p1_placed_s_ago: float = 0.0, hold_task_share: float = 0.5
):
    """p1 computes PROMPT on A (0.5 s predicted); B already has a request computing `queued_tokens` tokens;
    p2 shares PROMPT and is ranked onto B. `pace`: first tokens have come that many times as late as
    predicted; p1 was placed `p1_placed_s_ago` seconds before p2 is ranked (its placement time moved back:
    no clock is waited on). Returns (p2 held, the extra waits asked of the policy, p2's predicted cached
    tokens once sent, router)."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router, a, b = await lmcache_router()
        router.policy = stub = _Queued(True)
        router._policies = {"kvmesh": stub}
        router.hold_task_share = hold_task_share
        if pace > 1.0:
            router.prefill_pace.observe(pace * 0.05, 0.05)
        p1 = fake_request(PROMPT, "p1")
        await router.choose_replicas([a, b], p1)
        router._routed(p1, a.replica_id)
        router._inflight["i-p1"].routed_at -= p1_placed_s_ago
        busy = fake_request([(i * 31) % 900 + 5 for i in range(queued_tokens)], "busy")
        await router.choose_replicas([a, b], busy)
        router._routed(busy, b.replica_id)
        p2 = fake_request(PROMPT + [11, 12, 13], "p2")
        task = asyncio.create_task(router.choose_replicas([a, b], p2))
        await asyncio.sleep(0.05)
        held = not task.done()
        router.first_token("p1")
        ranked = await asyncio.wait_for(task, 5)
        router._routed(p2, ranked[0][0].replica_id)
        return held, stub.asked, local_state.LEDGER.prediction("p2"), router

    return asyncio.run(scenario())


def test_a_hold_is_weighed_by_the_wait_beyond_its_replicas_own_queue(monkeypatch):
    """B's queue (0.3 s) is waited anyway: holding p2 there costs only the rest of p1's 0.5 s prefill, as the
    policy ranks and the simulator holds (before: the whole 0.5 s, refused, and p2 computed the prefix)."""
    held, asked, predicted, router = queued_hold_scenario(monkeypatch, queued_tokens=3000)
    assert len(asked) == 1 and 0.15 < asked[0] < 0.25, asked
    assert held and router.held_for_tier == 1
    assert predicted == 320


def test_a_prefix_stored_before_its_replicas_queue_lets_it_start_is_credited_without_a_hold(monkeypatch):
    """B's queue (0.8 s) outlasts p1's prefill (0.5 s): p2 is sent at once and finds the prefix stored when
    vLLM schedules it, as the simulator counts it (before: asked to hold 0.5 s, refused, no credit)."""
    held, asked, predicted, router = queued_hold_scenario(monkeypatch, queued_tokens=8000)
    assert not held and asked == [] and router.held_for_tier == 0
    assert predicted == 320


def test_whether_a_prefix_needs_a_hold_is_decided_at_the_measured_pace(monkeypatch):
    """First tokens have come ten times as late as predicted, and p1 was placed 0.3 s ago: 0.2 s of its
    0.5 s prefill are left at the predicted pace, 4.7 s at the measured one, against B's queue of 0.3 s
    predicted, 3 s at that pace. p2 is held for p1's prefix (before: credited without a hold, sent at once,
    and it computed the prefix p1 had not stored yet); the hold is weighed in the policy's seconds, 0.47 s
    left less the 0.3 s queue."""
    held, asked, predicted, router = queued_hold_scenario(monkeypatch, 3000, pace=10.0, p1_placed_s_ago=0.3)
    assert held and router.held_for_tier == 1
    assert len(asked) == 1 and 0.15 < asked[0] < 0.2, asked
    assert predicted == 320  # loaded once p1's first token came back
    # on schedule at the measured pace, behind a queue that outlasts it (8 s at that pace): no hold needed
    held, asked, predicted, router = queued_hold_scenario(monkeypatch, 8000, pace=10.0, p1_placed_s_ago=0.3)
    assert not held and asked == [] and predicted == 320


def test_a_source_past_its_predicted_end_is_held_for_not_credited_as_stored(monkeypatch):
    """p1 was placed 0.6 s ago and its prefill predicted at 0.5 s: late, its first token not back. However
    short B's queue (0.01 s), p2 is held for it as for any prefix not stored (before: 0 s left counted as
    done, p2 was credited the prefix without a hold and computed it); the wait it is weighed on is none."""
    held, asked, predicted, router = queued_hold_scenario(monkeypatch, 100, p1_placed_s_ago=0.6)
    assert held and router.held_for_tier == 1 and asked == [0.0]
    assert predicted == 320


def test_with_every_hold_slot_taken_a_prefix_that_needs_no_hold_is_still_credited(monkeypatch):
    """No hold is allowed (`hold_task_share` 0). B's queue (0.8 s) outlasts p1's prefill (0.5 s): p2 is sent
    at once and finds the prefix stored, so it is ranked knowing B can load it and credited it (before: only
    prefixes already stored counted, and p2 predicted none). A late p1 needs a hold it cannot get: no credit."""
    held, asked, predicted, router = queued_hold_scenario(monkeypatch, 8000, hold_task_share=0.0)
    assert not held and router.held_for_tier == 0 and router.holds_full >= 1
    assert predicted == 320
    assert router.policy.inflight["p2"][0]["B"] == 10  # ranked with it
    held, asked, predicted, router = queued_hold_scenario(monkeypatch, 8000, p1_placed_s_ago=0.6, hold_task_share=0.0)
    assert not held and router.held_for_tier == 0 and predicted == 0
    assert router.policy.inflight["p2"][0] is None


def test_a_credit_without_a_hold_is_taken_back_when_its_source_never_stores_the_prefix(monkeypatch):
    """p2 is credited p1's prefix without a hold (B's queue outlasts p1's prefill) and sent; then A, computing
    p1, dies before p1's first token. p2 will compute the prefix: its pending prefill on B, its policy's
    credited work and its prediction in the ledger count the whole prompt again (before: 3 tokens and 320
    cached, a mismatch for the ledger's hash alarm and B's load under-counted until p2's first token). The
    same before Serve has placed p2, p1 refused by A and routed again."""

    async def scenario(sent_first: bool):
        monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())
        router, a, b = await lmcache_router()
        router.policy = stub = _Queued(True)
        router._policies = {"kvmesh": stub}
        routed = []
        stub.on_routed = lambda info, rid, view=None: routed.append((info.request_id, rid, view.shared_blocks))
        p1 = fake_request(PROMPT, "p1")
        await router.choose_replicas([a, b], p1)
        router._routed(p1, a.replica_id)
        busy = fake_request([(i * 31) % 900 + 5 for i in range(8000)], "busy")
        await router.choose_replicas([a, b], busy)
        router._routed(busy, b.replica_id)
        p2 = fake_request(PROMPT + [11, 12, 13], "p2")
        ranked = await asyncio.wait_for(router.choose_replicas([a, b], p2), 5)
        committed = list(routed)
        if sent_first:
            router._routed(p2, ranked[0][0].replica_id)
            assert (router._inflight["i-p2"].uncached, local_state.LEDGER.prediction("p2")) == (3, 320)
        if sent_first:
            router.replica_failed("A")  # p1 ends without its first token
        else:
            await router.choose_replicas([a, b], p1)  # A refused p1: Serve routes it again
        for _ in range(3):
            await asyncio.sleep(0)
        if not sent_first:
            router._routed(p2, ranked[0][0].replica_id)
        after = (router._inflight["i-p2"].uncached, local_state.LEDGER.prediction("p2"))
        return ranked[0][0].replica_id.unique_id, committed, after, list(routed), router

    for sent_first in (True, False):
        where, committed, after, routed, router = asyncio.run(scenario(sent_first))
        assert where == "B" and router.held_for_tier == 0
        assert committed[-1] == ("p2", "B", 10)
        assert after == (323, 0), sent_first
        assert [r for r in routed[len(committed) :] if r[0] == "p2"] == [("p2", "B", 0)]  # credited anew
        assert not router._unheld_credits
