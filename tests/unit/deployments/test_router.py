"""The router's ranking and bookkeeping with fake replicas (no Ray cluster, no engines): prefix holder first,
commitment before Serve places, moves and withdrawals, tenant policies, the hash-contract alarm."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from router_fakes import fake_request, make_router

from kvmesh.deployments import local_state
from kvmesh.deployments.prediction import PredictionLedger


# ---------------------------------------------------------------------------- router with fake replicas
def fake_replica(rid: str, **stats):
    return SimpleNamespace(
        replica_id=SimpleNamespace(unique_id=rid), routing_stats=stats, node_id="n0", max_ongoing_requests=64
    )


async def _two_replicas():
    """A kvmesh router over replicas A and B, both registered by a first request."""
    router = make_router(policy="kvmesh", block_size=32)
    a, b = fake_replica("A"), fake_replica("B")
    await router.choose_replicas([a, b], fake_request([1, 2, 3], "reg"))
    return router, a, b


def test_router_ranks_the_prefix_holder_first_and_records_its_prediction(monkeypatch):
    from kvmesh.kvstore.hashing import block_hashes

    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B")
        ids = list(range(10, 10 + 200))
        pending = fake_request(ids, "q1", salt="s1")
        await router.choose_replicas([a, b], fake_request([1, 2, 3], "reg"))  # registers both replicas
        router.index.store("B", block_hashes(ids[:160], 32, cache_salt="s1"))
        ranked = await router.choose_replicas([a, b], pending)
        assert [g[0].replica_id.unique_id for g in ranked] == ["B", "A"]
        router._routed(pending, b.replica_id)
        assert local_state.LEDGER.prediction("q1") == 160
        # another tenant's salt shares nothing: no preference from the cache
        other = fake_request(ids, "q2", salt="s2")
        await router.choose_replicas([a, b], other)
        router._routed(other, a.replica_id)
        assert local_state.LEDGER.prediction("q2") == 0
        # a replica that leaves is forgotten by the index
        await router.choose_replicas([a], fake_request(ids, "q3"))
        assert router.index.replicas() == ["A"]
        router.on_request_completed(b.replica_id, "i-q1")
        assert "i-q1" not in router._inflight

    asyncio.run(scenario())


def test_router_commits_to_its_first_choice_before_serve_places_the_request(monkeypatch):
    """Serve may rank a burst of cold requests while it is still probing queue lengths for the first.
    The router credits its first choice when it ranks, so each of four cold requests of different
    groups sees the others' work and they spread; without that, all four go to one replica (the live
    peer benchmark's chat: prefill max/mean 1.45, docs/peers.md)."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        reps = [fake_replica(n) for n in "ABCD"]
        burst = [fake_request([1000 * (k + 1) + i for i in range(300)], f"c{k}") for k in range(4)]
        firsts = []
        for p in burst:  # all ranked before any is placed
            firsts.append((await router.choose_replicas(reps, p))[0][0])
        assert len({r.replica_id.unique_id for r in firsts}) == 4
        # a request sharing c0's prompt, ranked before c0 is placed, already sees c0's blocks there
        twin = fake_request([1000 + i for i in range(300)] + [7], "twin")
        assert (await router.choose_replicas(reps, twin))[0][0] is firsts[0]
        for p, r in zip(burst + [twin], firsts + [firsts[0]]):
            router._routed(p, r.replica_id)
        assert router.fallbacks == 0

    asyncio.run(scenario())


def test_router_moves_its_commitment_when_serve_places_elsewhere(monkeypatch):
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B")
        p = fake_request(list(range(300)), "m1")
        first = (await router.choose_replicas([a, b], p))[0][0]
        other = b if first is a else a
        work = router.policy.recent_work()
        assert work[first.replica_id.unique_id] > work[other.replica_id.unique_id]
        await router.choose_replicas([a, b], p)  # ranked again (no replica free): not counted twice
        assert router.policy.recent_work() == work
        # one request, ranked twice: a decision and a re-ranking (per-request shares count requests)
        assert (router.decisions, router.rerankings) == (1, 1)
        router._routed(p, other.replica_id)  # Serve put it on the other replica
        moved = router.policy.recent_work()
        assert router.fallbacks == 1
        assert moved[other.replica_id.unique_id] == pytest.approx(work[first.replica_id.unique_id])
        assert moved[first.replica_id.unique_id] == pytest.approx(work[other.replica_id.unique_id])

    asyncio.run(scenario())


def test_router_non_engine_requests_go_to_any_replica():
    async def scenario():
        router = make_router(policy="round_robin")
        a, b = fake_replica("A"), fake_replica("B")
        assert await router.choose_replicas([a, b], None) == [[a, b]]
        assert await router.choose_replicas([a, b], SimpleNamespace(args=[], kwargs={})) == [[a, b]]

    asyncio.run(scenario())


def test_a_replica_whose_cache_was_reset_holds_nothing_in_the_index():
    from kvmesh.kvstore.hashing import block_hashes

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B")
        await router.choose_replicas([a, b], fake_request([1, 2, 3], "reg"))  # registers both replicas
        hashes = block_hashes(list(range(10, 10 + 96)), 32)
        router.index.store("A", hashes)
        router.index.store("B", hashes)
        router.cache_reset("B")
        router.cache_reset("never-seen")  # a replica the router never registered: nothing to forget
        assert router.held_blocks() == {"A": 3, "B": 0}

    asyncio.run(scenario())


def test_broken_hash_contract_raises_the_alarm_within_a_few_requests(monkeypatch):
    """The router hashing with another algorithm than the engines (index fed with sha256 keys, router
    hashing sha256_cbor) predicts 0 while engines deliver hits: the ledger alarms after 3 requests."""
    from kvmesh.kvstore.hashing import block_hashes

    ledger = PredictionLedger(alarm_after=3)
    monkeypatch.setattr(local_state, "LEDGER", ledger)

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32, hash_algo="sha256_cbor", mismatch_alarm_after=3)
        a = fake_replica("A")
        for i in range(3):
            ids = [7 + i] * 130
            pending = fake_request(ids, f"r{i}")
            await router.choose_replicas([a], pending)
            router.index.store("A", block_hashes(ids, 32, algo="sha256"))  # what the engine's events say
            await router.choose_replicas([a], pending)
            router._routed(pending, a.replica_id)
            ledger.deliver(f"r{i}", 128)  # what the engine reports
        return ledger.snapshot()

    snap = asyncio.run(scenario())
    assert snap["alarm"] and snap["mismatches"] == 3 and snap["predicted_tokens"] == 0


def test_router_uses_the_tenant_policy_the_ingress_sets(monkeypatch):
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B")
        firsts = []
        for i in range(4):
            pending = fake_request([5] * 64, f"t{i}")
            pending.args[0]["policy"] = "round_robin"
            ranked = await router.choose_replicas([a, b], pending)
            firsts.append(ranked[0][0].replica_id.unique_id)
            router._routed(pending, ranked[0][0].replica_id)
        assert sorted(firsts) == ["A", "A", "B", "B"]  # round robin ignores the shared prefix
        assert set(router._policies) == {"kvmesh", "round_robin"}
        assert all(st.policy.name == "round_robin" for st in router._inflight.values())

    asyncio.run(scenario())


def test_router_takes_back_a_placement_the_replica_rejected(monkeypatch):
    """Serve retries a request a replica rejected: the first placement's policy credit and its
    speculative blocks must not stay behind (they would count twice once the retry is placed)."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B")
        await router.choose_replicas([a, b], fake_request([1, 2, 3], "reg"))  # registers both replicas
        idle = dict(router.policy.recent_work())
        pending = fake_request(list(range(500, 800)), "q")
        first = (await router.choose_replicas([a, b], pending))[0][0]
        router._routed(pending, first.replica_id)
        rid = first.replica_id.unique_id
        assert router.policy.recent_work()[rid] > idle[rid]
        assert router.index.held_blocks(rid) > 0
        router._retried(pending)
        assert router.policy.recent_work() == pytest.approx(idle)
        assert router.index.held_blocks(rid) == 0 and "i-q" not in router._inflight

    asyncio.run(scenario())


def test_a_rejected_calls_completion_that_comes_before_the_retry_still_takes_the_placement_back(monkeypatch):
    """Serve cancels the call a replica rejected and reports its completion on the router's loop, where it may
    land before the retry is ranked: the rejected placement's credit and speculative blocks go all the same."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router, a, b = await _two_replicas()
        idle = dict(router.policy.recent_work())
        pending = fake_request(list(range(500, 800)), "q")
        first = (await router.choose_replicas([a, b], pending))[0][0]
        router._routed(pending, first.replica_id)
        router.on_request_completed(first.replica_id, "i-q")  # the rejected call, cancelled by Serve
        await router.choose_replicas([a, b], pending)  # the retry
        second = b if first is a else a  # the rejecting replica is full: Serve sends the retry to the other
        router._routed(pending, second.replica_id)
        added = {r: router.policy.recent_work()[r] - idle[r] for r in idle}
        assert added[first.replica_id.unique_id] == pytest.approx(0.0)
        assert added[second.replica_id.unique_id] > 0
        assert router.index.held_blocks(first.replica_id.unique_id) == 0

    asyncio.run(scenario())


def test_a_rejected_calls_completion_that_comes_after_the_retry_leaves_the_retry_counted(monkeypatch):
    """The same completion landing after the retry was placed elsewhere belongs to the earlier attempt: the
    request still runs on its new replica, which must keep counting it (queued, pending prefill)."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router, a, b = await _two_replicas()
        pending = fake_request(list(range(500, 800)), "q")
        first = (await router.choose_replicas([a, b], pending))[0][0]
        router._routed(pending, first.replica_id)
        await router.choose_replicas([a, b], pending)  # the retry, after the replica rejected it
        second = b if first is a else a
        router._routed(pending, second.replica_id)
        router.on_request_completed(first.replica_id, "i-q")  # the rejected call's completion, late
        assert router._inflight["i-q"].replica == second.replica_id.unique_id
        views = {v.replica_id: v for v in router._views([a, b], {})}
        assert views[second.replica_id.unique_id].pending_prefill_tokens > 0
        router.on_request_completed(second.replica_id, "i-q")
        assert "i-q" not in router._inflight

    asyncio.run(scenario())


def test_router_learns_placement_and_cancellation_from_the_requests_future(monkeypatch):
    """Serve resolves PendingRequest.future with the replica it chose, or cancels it when the caller
    goes away: the router books the placement from it, or takes its commitment back; a retried request
    (ranked again after its replica rejected it) withdraws the first placement."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router, a, b = await _two_replicas()
        idle = dict(router.policy.recent_work())

        placed = fake_request(list(range(500, 800)), "placed")
        placed.future = asyncio.get_running_loop().create_future()
        first = (await router.choose_replicas([a, b], placed))[0][0]
        placed.future.set_result(first)
        await asyncio.sleep(0)  # done callbacks run on the next loop turn
        assert router._inflight["i-placed"].replica == first.replica_id.unique_id
        placed.future = asyncio.get_running_loop().create_future()  # Serve's reset_future before a retry
        decisions = router.decisions
        await router.choose_replicas([a, b], placed)
        assert "i-placed" not in router._inflight and "i-placed" in router._routing
        assert (router.decisions, router.rerankings) == (decisions, 1)  # a retry is the same request
        placed.future.cancel()  # the client left while the retry waited for a replica
        await asyncio.sleep(0)
        assert "i-placed" not in router._routing

        gone = fake_request(list(range(900, 1200)), "gone")
        gone.future = asyncio.get_running_loop().create_future()
        await router.choose_replicas([a, b], gone)
        gone.future.cancel()
        await asyncio.sleep(0)
        assert "i-gone" not in router._routing and "i-gone" not in router._inflight
        assert router.policy.recent_work() == pytest.approx(idle)
        assert all(router.index.held_blocks(r) == 0 for r in ("A", "B"))

    asyncio.run(scenario())


def test_a_cancelled_request_leaves_the_prefix_another_request_computes_on_its_replica(monkeypatch):
    """Two requests with one prompt prefix are placed on one replica; the first one's caller leaves: the
    second still computes the prefix there, so the next request with that prefix is ranked there."""
    from kvmesh.kvstore.hashing import block_hashes

    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router, a, b = await _two_replicas()
        system = list(range(1000, 1000 + 16 * 32))
        first = fake_request([*system, *[1] * 40], "first")
        second = fake_request([*system, *[2] * 40], "second")
        for pending in (first, second):
            pending.future = asyncio.get_running_loop().create_future()
        there = (await router.choose_replicas([a, b], first))[0][0]
        await router.choose_replicas([a, b], second)
        second.future.set_result(there)  # Serve sends the second where the first was ranked
        await asyncio.sleep(0)
        first.future.cancel()  # the first one's client went away before Serve placed it
        await asyncio.sleep(0)
        prefix = block_hashes(system, 32, algo=router.hash_algo)
        assert router.index.match(prefix)[there.replica_id.unique_id][0] == 16

    asyncio.run(scenario())


def test_router_decision_trace_shows_what_ranking_saw(monkeypatch):
    """Each placement in `/kvmesh/state`'s trace carries every replica's view as ranking saw it (prefix
    blocks per tier, queue, pending prefill, the guard's work before this request), how often Serve had
    it ranked, and the policy's first choice where Serve placed it elsewhere."""
    from kvmesh.cluster.decision_trace import CELLS
    from kvmesh.kvstore.hashing import block_hashes

    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A", queued=2), fake_replica("B", queued=0)
        reg = fake_request([1, 2, 3], "reg")  # registers both replicas, and is over before the test
        where = (await router.choose_replicas([a, b], reg))[0][0].replica_id
        router._routed(reg, where)
        router.on_request_completed(where, "i-reg")
        ids = list(range(10, 10 + 200))
        router.index.store("B", block_hashes(ids[:160], 32))
        first = fake_request(ids, "t1")
        assert (await router.choose_replicas([a, b], first))[0][0] is b
        router._routed(first, b.replica_id)
        work = router.policy.recent_work()
        second = fake_request(list(range(5000, 5300)), "t2")
        top = (await router.choose_replicas([a, b], second))[0][0]
        await router.choose_replicas([a, b], second)  # ranked again before Serve places it
        other = b if top is a else a
        router._routed(second, other.replica_id)
        d1, d2 = router.recent_decisions()[-2:]
        assert (d1["request_id"], d1["chosen"], d1["rankings"]) == ("t1", "B", 1)
        assert len(d1["replicas"]["A"]) == len(CELLS)
        cells = dict(zip(CELLS, d1["replicas"]["B"]))
        assert (cells["hbm"], cells["shared"], cells["pending"]) == (5, 5, 0)
        assert dict(zip(CELLS, d1["replicas"]["A"]))["queued"] == 2  # the replica's own report
        assert d2["chosen"] == other.replica_id.unique_id and d2["first_choice"] == top.replica_id.unique_id
        assert d2["rankings"] == 2
        score = {r: c[CELLS.index("score")] for r, c in d2["replicas"].items()}
        assert min(score, key=score.__getitem__) == d2["first_choice"]  # the policy's scores, lowest first
        # the guard's work as it was before the request was ranked: t1's credit on B, nothing yet for t2
        assert {r: c[CELLS.index("work")] for r, c in d2["replicas"].items()} == pytest.approx(work, abs=0.1)
        assert dict(zip(CELLS, d2["replicas"]["B"]))["pending"] == 200 - 160

    asyncio.run(scenario())


def test_a_decision_record_stays_small_however_many_replicas_hold_the_prefix(monkeypatch):
    """A prefix every replica holds (a common system prompt in a shared tier) must not put every replica in each
    placement's record: its cached blocks are those of the replicas it lists (`TRACED_REPLICAS` + the top one)
    and of the one Serve placed it on, however large the fleet."""
    import json

    from kvmesh.cluster.decision_trace import TRACED_REPLICAS
    from kvmesh.kvstore.hashing import block_hashes

    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        reps = [fake_replica(f"R{k:03d}") for k in range(64)]
        await router.choose_replicas(reps, fake_request([1, 2, 3], "reg"))  # registers them all
        system = list(range(10, 10 + 256))
        for r in reps:
            router.index.store(r.replica_id.unique_id, block_hashes(system, 32, algo=router.hash_algo))
        pending = fake_request(system + [7, 8, 9], "big")
        await router.choose_replicas(reps, pending)
        listed = set(router._routing["i-big"].cells)
        elsewhere = next(r for r in reps if r.replica_id.unique_id not in listed)
        router._routed(pending, elsewhere.replica_id)  # Serve placed it off the ranked ones
        d = router.recent_decisions()[-1]
        assert len(d["replicas"]) <= TRACED_REPLICAS + 1
        assert set(d["cached_blocks"]) == set(d["replicas"]) | {elsewhere.replica_id.unique_id}
        assert set(d["cached_blocks"].values()) == {8}
        assert len(json.dumps(d)) < 2000  # the ~0.5 KB a decision is budgeted, give or take a few replicas

    asyncio.run(scenario())


def test_a_request_committed_and_not_yet_placed_is_queued_on_its_replica_for_the_next_ranking(monkeypatch):
    """Serve probes an empty replica's queue length before it places the first requests, and ranks the rest
    of a burst meanwhile: each must see the ones committed before it as queued, with their prefill pending,
    as the simulator counts them, or the burst piles onto the replica holding its shared prefix."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A", queued=0), fake_replica("B", queued=0)
        first = fake_request(list(range(1000, 1100)), "q1")
        chosen = (await router.choose_replicas([a, b], first))[0][0].replica_id.unique_id
        views = {v.replica_id: v for v in router._views([a, b], {})}
        assert (views[chosen].queued, views[chosen].pending_prefill_tokens) == (1, 100)
        other = "B" if chosen == "A" else "A"
        assert (views[other].queued, views[other].pending_prefill_tokens) == (0, 0)
        router._routed(first, SimpleNamespace(unique_id=chosen))  # placed: counted once, as in flight
        views = {v.replica_id: v for v in router._views([a, b], {})}
        assert (views[chosen].queued, views[chosen].pending_prefill_tokens) == (1, 100)

    asyncio.run(scenario())


def test_each_router_names_itself_in_its_snapshot_so_counter_diffs_stay_within_one():
    """Counters in a snapshot start at 0 with their router (a restart, another ingress replica): a reader
    diffing two snapshots compares their `instance` first."""
    a, b = make_router(policy="kvmesh", block_size=32), make_router(policy="kvmesh", block_size=32)
    assert a.snapshot()["instance"] == a.snapshot()["instance"] != b.snapshot()["instance"]


def test_an_engine_hashing_other_blocks_than_the_router_is_reported_once(monkeypatch, caplog):
    """Another block size or hash algorithm makes every key the engine publishes one no request looks up:
    the router says so once per replica, keeps it in /kvmesh/state, and ignores the events of that size."""
    from kvmesh.cluster.kv_events import BlockStored

    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32, hash_algo="sha256")
        a = fake_replica("A", block_size=16, hash_algo="xxhash", num_blocks=64)
        b = fake_replica("B", block_size=32, hash_algo="sha256", num_blocks=64)
        late = fake_replica("C")  # no routing stats yet: checked when they come
        with caplog.at_level("WARNING", logger="kvmesh.deployments.router"):
            for i in range(3):
                await router.choose_replicas([a, b, late], fake_request([1, 2, 3], f"q{i}"))
            late.routing_stats = {"block_size": 64, "hash_algo": "sha256"}
            await router.choose_replicas([a, b, late], fake_request([1, 2, 3], "q9"))
        state = router.snapshot()["engine_config_mismatch"]
        assert state == {
            "A": {
                "block_size": {"engine": 16, "router": 32},
                "hash_algo": {"engine": "xxhash", "router": "sha256"},
            },
            "C": {"block_size": {"engine": 64, "router": 32}},
        }
        warned = [r.getMessage() for r in caplog.records if "hashes KV blocks otherwise" in r.getMessage()]
        assert len(warned) == 2 and "replica A" in warned[0] and "replica C" in warned[1]
        router.tiers.apply_events("A", [BlockStored([5, 6], block_size=16)])
        assert router.index.stats["block_size_mismatch"] == 1 and router.index.match([5])["A"][0] == 0
        await router.choose_replicas([b, late], fake_request([1, 2, 3], "q10"))  # A left: forgotten
        assert "A" not in router.snapshot()["engine_config_mismatch"]

    asyncio.run(scenario())


def test_a_request_for_its_prompts_log_probabilities_is_placed_as_reading_no_cache(monkeypatch):
    """vLLM computes the whole prompt of a request that asks for the prompt's log-probabilities (an echoed
    completion's), reading no cache: the router predicts no hit for it and does not send it to the holder
    for a hit it will not get. The same prompt without them goes to the holder, predicted cached."""
    from kvmesh.kvstore.hashing import block_hashes

    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32)
        a, b = fake_replica("A"), fake_replica("B")
        ids = list(range(10, 10 + 200))
        await router.choose_replicas([a, b], fake_request([1, 2, 3], "reg"))
        router.index.store("B", block_hashes(ids[:160], 32))
        plain = fake_request(ids, "plain")
        assert [g[0].replica_id.unique_id for g in await router.choose_replicas([a, b], plain)][0] == "B"
        router._routed(plain, b.replica_id)
        assert local_state.LEDGER.prediction("plain") == 160
        scored = fake_request(ids, "scored")
        scored.args[0]["params"]["prompt_logprobs"] = 0
        ranked = await router.choose_replicas([a, b], scored)
        assert ranked[0][0].replica_id.unique_id == "A"  # by load: B holds the prefix and has the work
        router._routed(scored, b.replica_id)
        assert local_state.LEDGER.prediction("scored") == 0

    asyncio.run(scenario())


def test_a_prompts_samples_follow_the_first_to_its_replica_as_vllms_n_keeps_them_on_one_engine(monkeypatch):
    """Sixteen samples of one long prompt (`n` 16), ranked before any is placed: ranked each as a request of its own,
    the balance guard sends some elsewhere, where the prompt would be computed again. With the key they share,
    every later sample goes where the first went, predicted to find the prompt cached (vLLM computes it once
    for all, a later sample finding its blocks as soon as they are allocated); a sample of another prompt, or
    one whose first sample's replica is gone, is placed by the policy as before."""
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())
    prompt = list(range(5000, 5000 + 640))

    async def burst(key: str | None) -> tuple[list[str], object]:
        router = make_router(policy="kvmesh", block_size=32)
        reps = [fake_replica(n) for n in "ABC"]
        await router.choose_replicas(reps, fake_request([1, 2, 3], "reg"))
        samples = [fake_request(prompt, f"{key}-s{k}") for k in range(16)]
        chosen = []
        for p in samples:
            if key is not None:
                p.args[0]["samples_of"] = key
            chosen.append((await router.choose_replicas(reps, p))[0][0].replica_id.unique_id)
        for p, rid in zip(samples, chosen):
            router._routed(p, SimpleNamespace(unique_id=rid))
        return chosen, router

    apart, _ = asyncio.run(burst(None))
    assert len(set(apart)) > 1  # what the policy does with them alone
    together, router = asyncio.run(burst("parent:0"))
    assert len(set(together)) == 1
    assert [local_state.LEDGER.prediction(f"parent:0-s{k}") for k in range(1, 16)] == [640 - 32] * 15

    async def after():
        reps = [fake_replica(n) for n in "ABC"]
        other = fake_request(list(range(9000, 9000 + 640)), "other")
        other.args[0]["samples_of"] = "parent:1"  # the batch's next prompt: its own placement
        first_other = (await router.choose_replicas(reps, other))[0][0].replica_id.unique_id
        assert first_other != together[0]  # the policy's choice: the first prompt's replica has its work
        left = [r for r in reps if r.replica_id.unique_id != together[0]]
        late = fake_request(prompt, "late")
        late.args[0]["samples_of"] = "parent:0"  # its first sample's replica is no candidate now
        assert (await router.choose_replicas(left, late))[0][0].replica_id.unique_id in {"A", "B", "C"} - {together[0]}

    asyncio.run(after())
