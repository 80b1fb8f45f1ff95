"""Placement policies: interface contract for every policy, and the behaviour each one promises."""

from __future__ import annotations

import math

import numpy as np
import pytest
from replica_views import views

from kvmesh.policies.base import FleetView, RequestInfo
from kvmesh.policies.cost_model import CostModel, cacheable_blocks, cached_tokens
from kvmesh.policies.registry import BASELINES, PEERS, POLICY_NAMES, make_policy, parse_policy_list

BS = 512


def req(hashes, n=None, rid=None):
    n = n if n is not None else len(hashes) * BS
    return RequestInfo(list(hashes), n, BS, 100, None, rid)


def view(vs, rid):
    """The view of replica `rid` among `vs` (what the router hands on_routed)."""
    return next(v for v in vs if v.replica_id == rid)


def route(p, r, vs, rid=None):
    """Rank `r` on `vs` and route it to `rid` (default: the first choice) as the router does: the
    replicas it sees have joined the fleet, and on_routed gets the chosen replica's view."""
    for v in vs:
        p.on_replica_added(v.replica_id)
    rid = rid or p.rank(r, vs)[0]
    p.on_routed(r, rid, view(vs, rid))
    return rid


def test_registry_lists_every_required_policy():
    assert set(POLICY_NAMES) == {"kvmesh", *BASELINES, *PEERS}
    assert set(BASELINES) == {"round_robin", "random", "least_loaded", "power_of_two", "consistent_hash"}
    assert set(PEERS) == {"sglang_cache_aware", "ray_prefix_affinity", "llmd_precise", "dynamo_cost"}
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("nope")
    assert parse_policy_list("all") == list(POLICY_NAMES)
    assert parse_policy_list("kvmesh, round_robin,kvmesh") == ["kvmesh", "round_robin"]
    with pytest.raises(ValueError):
        parse_policy_list("kvmesh,bogus")
    with pytest.raises(ValueError):
        parse_policy_list(" , ")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_ranks_a_permutation_and_is_deterministic(name):
    import random

    def run(seed):
        rng = random.Random(7)
        p = make_policy(name, seed=seed)
        picks = []
        for i in range(60):
            vs = views(
                5,
                hbm_blocks={rng.randrange(5): rng.randrange(4)},
                queued={rng.randrange(5): rng.randrange(3)},
                running={rng.randrange(5): rng.randrange(3)},
            )
            for v in vs:
                v.host_blocks = v.shared_blocks = v.hbm_blocks
            r = req([rng.randrange(6), rng.randrange(50), rng.randrange(50)], rid=str(i))
            ranked = p.rank(r, vs)
            assert sorted(ranked) == sorted(v.replica_id for v in vs), name
            p.on_routed(r, ranked[0], view(vs, ranked[0]))
            picks.append(ranked[0])
        return picks

    a, b = run(3), run(3)
    assert a == b
    assert len(set(a)) > 1  # nobody sends 60 varied requests to one replica


def test_unknown_policy_parameters_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="kvmesh: unknown parameter.*recompute_wieght.*known:.*recompute_weight"):
        make_policy("kvmesh", recompute_wieght=31)
    with pytest.raises(ValueError, match="round_robin: unknown parameter.*known: none"):
        make_policy("round_robin", vnodes=3)
    # a parameter a subclass passes on to its base's constructor is known too
    assert make_policy("consistent_hash", vnodes=3).vnodes == 3


def test_cost_model_formula_and_validation():
    c = CostModel(
        prefill_s_per_token=1e-3, prefill_base_s=0.5, host_load_s_per_token=1e-4, shared_load_s_per_token=5e-4
    )
    # 1000 tokens: 100 in hbm, 200 more in host, 300 more in shared, 400 recomputed
    assert c.prefill_s(1000, 100, 300, 600) == pytest.approx(0.5 + 400e-3 + 300 * 5e-4 + 200 * 1e-4)
    assert CostModel.from_dict({"prefill_s_per_token": 2e-4}).prefill_s_per_token == 2e-4
    # the attention term: the 400 computed tokens (600..999) each attend to the tokens before them
    quad = CostModel.from_dict(dict(c.to_dict(), attention_s_per_token_pair=1e-6))
    pairs = (1000**2 - 600**2) / 2
    assert quad.prefill_s(1000, 100, 300, 600) == pytest.approx(c.prefill_s(1000, 100, 300, 600) + pairs * 1e-6)
    with pytest.raises(ValueError, match="unknown keys"):
        CostModel.from_dict({"prefil_s_per_token": 1})
    with pytest.raises(ValueError):
        CostModel(prefill_s_per_token=-1)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"prefill_s_per_token": math.nan}, "prefill_s_per_token must be a finite number >= 0"),
        ({"decode_s_per_token": math.inf}, "decode_s_per_token must be a finite"),
        ({"prefill_base_s": 10**400}, "prefill_base_s must be a finite"),
        ({"max_batch": 1.5}, "max_batch must be a whole number"),
        ({"max_batch": True}, "max_batch must be a whole number"),
    ],
)
def test_cost_model_values_must_be_finite_and_max_batch_whole(values, message):
    """NaN passed `v < 0` and changed placements; an infinity or a 400-digit integer overflowed the sums."""
    with pytest.raises(ValueError, match=message):
        CostModel.from_dict(values)


def test_cost_model_takes_a_calibrators_result_document():
    """What `calibrate.py` and `calibrate_accelerator.py` write with --json (the constants under "cost_model",
    beside "measured" and "defaults") was refused for its unknown keys."""
    constants = {"prefill_s_per_token": 2.6e-5, "prefill_base_s": 0.0, "decode_s_per_token": 0.01}
    doc = {"cost_model": constants, "measured": {"device": "x"}, "defaults": CostModel().to_dict()}
    assert CostModel.from_dict(doc) == CostModel.from_dict(constants)
    with pytest.raises(ValueError, match="'cost_model' must be an object"):
        CostModel.from_dict({"cost_model": 5})


@pytest.mark.parametrize(
    "values, message",
    [
        ({"prefill_base_s": 10}, "prefill_base_s = 10 s per request is above 1 s per request"),
        ({"decode_s_per_token": 10}, "decode_s_per_token = 10 s per output token"),
        ({"prefill_s_per_token": 0.5}, "prefill_s_per_token = 0.5 s per token is above 0.1 s per token"),
        ({"host_load_s_per_token": 0.2}, "host_load_s_per_token = 0.2 s per token"),
    ],
)
def test_cost_model_refuses_values_no_engine_has(values, message):
    """Milliseconds given where seconds are meant passed: prefill_base_s 10 (meant: 10 ms) made every request
    cost 10 s more."""
    with pytest.raises(ValueError, match=message) as exc:
        CostModel.from_dict(values)
    assert "in seconds" in str(exc.value)


def test_a_partial_cost_model_says_which_constants_are_defaults(caplog, monkeypatch):
    """The tiny CPU engine's file gives 3 constants; the tier loads and max_batch came from the 8B-on-H100
    defaults without a word."""
    from kvmesh.policies import cost_model

    monkeypatch.setattr(cost_model, "_DEFAULTS_SAID", set())
    with caplog.at_level("WARNING", logger="kvmesh.policies.cost_model"):
        CostModel.from_dict({"prefill_s_per_token": 1.2e-5, "prefill_base_s": 7.7e-4, "decode_s_per_token": 2e-3})
    (record,) = caplog.records
    text = record.getMessage()
    assert record.levelname == "WARNING" and "\n" not in text
    for name in ("host_load_s_per_token", "shared_load_s_per_token", "max_batch", "attention_s_per_token_pair"):
        assert name in text
    assert "prefill_s_per_token" not in text and "defaults" in text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvmesh.policies.cost_model"):
        CostModel.from_dict(CostModel().to_dict())  # every constant given
        CostModel.from_dict({})  # none given: the defaults asked for
    assert caplog.records == []


def test_the_defaults_warning_is_said_once_per_process(caplog, monkeypatch):
    """A config's policy cost is checked each time the config is (about six times on the way to Serve): the
    same warning was logged each time."""
    from kvmesh.policies import cost_model

    monkeypatch.setattr(cost_model, "_DEFAULTS_SAID", set())
    with caplog.at_level("WARNING", logger="kvmesh.policies.cost_model"):
        for _ in range(3):
            CostModel.from_dict({"prefill_s_per_token": 1.2e-5})
        CostModel.from_dict({"prefill_base_s": 1e-3})  # other constants left at their defaults: said too
    assert len(caplog.records) == 2


@pytest.mark.parametrize("beside", [{"decode_s_per_token": 0.01}, {"decode_s_per_tokn": 0.01}, {"note": "x"}])
def test_a_key_beside_a_calibrators_cost_model_is_refused_not_dropped(beside):
    """A constant added beside a calibrator's "cost_model" (or a typo) was dropped without a word: the default
    stood in for it."""
    doc = {"cost_model": {"prefill_s_per_token": 2.6e-5}, "measured": {}, "defaults": {}, **beside}
    with pytest.raises(ValueError, match="put constants inside 'cost_model'"):
        CostModel.from_dict(doc)


def test_cached_token_rules_follow_vllm():
    assert cached_tokens(3, 3 * BS, BS) == 2 * BS  # the last token is always computed: last block recomputed
    assert cached_tokens(3, 3 * BS + 1, BS) == 3 * BS
    assert cached_tokens(5, 2 * BS + 10, BS) == 2 * BS
    assert cached_tokens(0, 100, BS) == 0
    assert cacheable_blocks(2 * BS + 10, 3, BS) == 2  # partial last block is not cached
    assert cacheable_blocks(3 * BS, 3, BS) == 3


# ----------------------------------------------------------------------------------------- kvmesh
def test_kvmesh_prefers_the_replica_holding_the_prefix():
    p = make_policy("kvmesh")
    vs = views(4, hbm_blocks={2: 8}, host_blocks={2: 8}, shared_blocks={2: 8})
    assert p.rank(req(range(10)), vs)[0] == "r2"


def test_kvmesh_predicts_the_attention_a_held_prefix_saves():
    cost = CostModel(prefill_s_per_token=1e-4, prefill_base_s=0.0, attention_s_per_token_pair=1e-8)
    p = make_policy("kvmesh", cost=cost)
    vs = views(2, hbm_blocks={1: 8}, host_blocks={1: 8}, shared_blocks={1: 8})
    r = req(range(10))
    n, held = r.num_tokens, 8 * r.block_size
    cold, _ = p.predict(r, vs[0])
    warm, _ = p.predict(r, vs[1])
    assert cold == pytest.approx(n * 1e-4 + n * n / 2 * 1e-8)
    assert warm == pytest.approx((n - held) * 1e-4 + (n * n - held * held) / 2 * 1e-8)


def test_kvmesh_leaves_a_holder_whose_queue_costs_more_than_the_hit_saves():
    p = make_policy("kvmesh", recompute_weight=0.0)
    # r0 holds 8 of 10 blocks (saves ~0.4 s) but has 100k tokens queued (~10 s of prefill ahead)
    vs = views(
        3,
        hbm_blocks={0: 8},
        host_blocks={0: 8},
        shared_blocks={0: 8},
        pending_prefill_tokens={0: 100_000},
        queued={0: 5},
    )
    assert p.rank(req(range(10)), vs)[0] != "r0"
    # with a short queue it stays
    vs[0].pending_prefill_tokens, vs[0].queued = 1000, 1
    assert p.rank(req(range(10)), vs)[0] == "r0"


def test_kvmesh_tier_credits_order_hbm_host_shared_none():
    p = make_policy("kvmesh")
    vs = views(4)
    vs[0].hbm_blocks = vs[0].host_blocks = vs[0].shared_blocks = 8  # in its own cache
    vs[1].host_blocks = vs[1].shared_blocks = 8  # in its node's host DRAM
    vs[2].shared_blocks = 8  # in the shared tier only
    r = req(range(10))
    assert p.rank(r, vs) == ["r0", "r1", "r2", "r3"]
    pred = [p.predict(r, v)[0] for v in vs]
    assert pred[0] < pred[1] < pred[2] < pred[3]


def test_kvmesh_spreads_requests_that_share_one_system_prompt():
    """Every replica holds the system prompt (block 0); new conversations must not pile onto one."""
    p = make_policy("kvmesh")
    counts = {}
    for i in range(80):
        vs = views(
            8,
            hbm_blocks=dict.fromkeys(range(8), 1),
            host_blocks=dict.fromkeys(range(8), 1),
            shared_blocks=dict.fromkeys(range(8), 1),
        )
        r = req([0, 1000 + i, 2000 + i, 3000 + i], rid=str(i))
        rid = route(p, r, vs)
        counts[rid] = counts.get(rid, 0) + 1
    assert len(counts) == 8
    assert max(counts.values()) <= 11  # 10 each on average


def test_kvmesh_guard_overrides_affinity_for_an_overworked_replica():
    p = make_policy("kvmesh", balance_slack=0.1)
    # r0 owns a popular prefix: send it a lot of work via on_routed (as if routed before)
    for i in range(50):
        r = req([0, i + 100], rid=f"w{i}")
        route(p, r, views(4), "r0")
    work = p.recent_work()
    assert work["r0"] > 1.1 * (sum(work.values()) / 4)
    vs = views(4, hbm_blocks={0: 9}, host_blocks={0: 9}, shared_blocks={0: 9})
    assert p.rank(req(range(10)), vs)[0] != "r0"
    # without the guard (huge slack) affinity wins again
    q = make_policy("kvmesh", balance_slack=1e9)
    for i in range(50):
        r = req([0, i + 100], rid=f"w{i}")
        route(q, r, views(4), "r0")
    assert q.rank(req(range(10)), vs)[0] == "r0"


def test_kvmesh_new_replica_starts_at_the_mean_and_removed_one_is_forgotten():
    p = make_policy("kvmesh")
    for rid in ("r0", "r1"):
        p.on_replica_added(rid)
    for i in range(20):
        route(p, req([i], rid=str(i)), views(2))
    before = p.recent_work()
    p.rank(req([99]), views(3))
    assert p.recent_work() == before  # ranking with a replica not yet added changes nothing
    p.on_replica_added("r2")
    after = p.recent_work()
    assert after["r2"] == pytest.approx(sum(before.values()) / 2)
    p.on_replica_removed("r2")
    assert "r2" not in p.recent_work()


def test_kvmesh_rejects_bad_parameters():
    with pytest.raises(ValueError):
        make_policy("kvmesh", balance_slack=-1)
    with pytest.raises(ValueError):
        make_policy("kvmesh", cost={"max_batch": 0})


# -------------------------------------------------------------------------------------- baselines
def test_round_robin_cycles_and_least_loaded_picks_minimum():
    rr = make_policy("round_robin")
    assert [route(rr, req([1]), views(3)) for _ in range(4)] == ["r0", "r1", "r2", "r0"]
    assert rr.rank(req([1]), views(3)) == rr.rank(req([1]), views(3))  # ranking alone does not turn it
    ll = make_policy("least_loaded")
    assert ll.rank(req([1]), views(3, queued={0: 2, 1: 1, 2: 3}))[0] == "r1"


def test_power_of_two_picks_the_less_loaded_of_its_sample():
    p = make_policy("power_of_two", seed=1)
    for _ in range(50):
        vs = views(4, queued={0: 9, 1: 0, 2: 9, 3: 9})
        first, second = p.rank(req([1]), vs)[:2]
        # the busier of the two sampled never comes first
        assert vs[int(first[1:])].queued <= vs[int(second[1:])].queued


def test_consistent_hash_keys_on_the_first_block():
    p = make_policy("consistent_hash")
    a = p.rank(req([42, 1, 2]), views(8))[0]
    assert all(p.rank(req([42, x]), views(8))[0] == a for x in range(20))
    assert len({p.rank(req([k]), views(8))[0] for k in range(200)}) == 8


# ------------------------------------------------------------------------------------------ peers
def test_sglang_cache_aware_modes():
    p = make_policy("sglang_cache_aware", balance_abs_threshold=4, balance_rel_threshold=1.5)
    first = p.rank(req([1, 2, 3, 4]), views(3))[0]  # no match, equal loads: the first worker
    p.on_routed(req([1, 2, 3, 4]), first)
    # 3 of 4 blocks match (> 0.3): the same worker, even when busier
    busy = views(3, queued={int(first[1:]): 2})
    assert p.rank(req([1, 2, 3, 9]), busy)[0] == first
    # 1 of 4 matches (0.25 <= 0.3): the least loaded worker
    assert p.rank(req([1, 7, 8, 9]), busy)[0] != first
    # imbalanced (10 - 0 > 4 and 10 > 1.5 * 0): shortest queue wins over the match
    vs = views(3, queued={int(first[1:]): 10})
    other = {"r0", "r1", "r2"} - {first}
    assert p.rank(req([1, 2, 3, 4]), vs)[0] in other


def test_ray_prefix_affinity_match_threshold_and_smallest_tenant():
    p = make_policy("ray_prefix_affinity")
    p.on_routed(req(list(range(10))), "r1")
    p.on_routed(req([100, 101]), "r2")
    assert p.rank(req(list(range(10)) + [55]), views(3))[0] == "r1"  # 10/11 >= 0.1
    assert p.rank(req([500, 501]), views(3))[0] == "r0"  # no match: the empty (smallest) tree


def test_llmd_precise_weighs_prefix_queue_and_kv_usage():
    p = make_policy("llmd_precise")
    # 5 of 6 blocks on r0 (2 x 5/6), its queue the longest (0) and its KV full (0) vs idle r1 (queue 1 + kv 1)
    vs = views(2, hbm_blocks={0: 5}, queued={0: 4}, kv_usage={0: 1.0})
    assert p.rank(req(range(6)), vs)[0] == "r1"  # 1.67 < 1 + 1
    vs = views(2, hbm_blocks={0: 5}, queued={0: 4})
    assert p.rank(req(range(6)), vs)[0] == "r0"  # 1.67 + 1 > 1 + 1


def test_dynamo_cost_is_prefill_blocks_plus_active_blocks():
    p = make_policy("dynamo_cost")
    # r0: 6 of 8 blocks cached but 4 blocks of prefill queued + 3 active; r1: cold, idle
    vs = views(2, hbm_blocks={0: 6}, pending_prefill_tokens={0: 4 * BS})
    vs[0].extra["active_blocks"] = 3
    vs[1].extra["active_blocks"] = 0
    # r0: (4*512 + 2*512)/512 + 3 + 8 = 17 ; r1: 8 + 0 + 8 = 16
    assert p.rank(req(range(8)), vs)[0] == "r1"
    vs[0].extra["active_blocks"] = 1  # r0: 6 + 1 + 8 = 15 < 16
    assert p.rank(req(range(8)), vs)[0] == "r0"


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_candidates_gives_an_empty_ranking(name):
    assert make_policy(name).rank(req([1, 2]), []) == []


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_place_on_a_fleet_matches_rank(name):
    """The array entry point decides exactly like rank() (two instances fed the same sequence)."""
    import random

    import numpy as np

    from kvmesh.policies.base import FleetView

    rng = random.Random(11)
    a, b = make_policy(name, seed=2), make_policy(name, seed=2)
    for i in range(80):
        vs = views(6)
        for v in vs:
            v.hbm_blocks = rng.randrange(4)
            v.host_blocks = v.hbm_blocks + rng.randrange(2)
            v.shared_blocks = v.host_blocks + rng.randrange(2)
            v.queued, v.running = rng.randrange(4), rng.randrange(4)
            v.pending_prefill_tokens = rng.randrange(5000)
            v.kv_usage = rng.random()
        r = req([rng.randrange(3)] + [rng.randrange(100) for _ in range(5)], rid=str(i))
        fleet = FleetView(
            [v.replica_id for v in vs],
            *(
                np.array([getattr(v, f) for v in vs])
                for f in (
                    "hbm_blocks",
                    "host_blocks",
                    "shared_blocks",
                    "queued",
                    "running",
                    "kv_usage",
                    "pending_prefill_tokens",
                    "capacity_blocks",
                )
            ),
        )
        by_rank = a.rank(r, vs)
        by_place = [fleet.ids[k] for k in b.place(r, fleet)]
        assert by_rank == by_place, (name, i)
        a.on_routed(r, by_rank[0], view(vs, by_rank[0]))
        b.on_routed(r, by_place[0], fleet.view(fleet.ids.index(by_place[0])))


def test_kvmesh_credits_each_request_its_own_prediction_when_routings_interleave():
    p = make_policy("kvmesh")
    warm = views(2, hbm_blocks={0: 9}, host_blocks={0: 9}, shared_blocks={0: 9})
    a = req(range(10), rid="a")  # 9 blocks cached on r0: (5120-1) // 512 = 9 -> 512 tokens computed there
    b = req(range(100, 110), rid="b")  # cold everywhere: 5120 computed
    p.on_replica_added("r0")
    p.on_replica_added("r1")
    p.rank(a, warm)
    p.rank(b, views(2))
    p.on_routed(b, "r1", view(views(2), "r1"))
    p.on_routed(a, "r0", view(warm, "r0"))
    work = p.recent_work()
    assert work["r0"] == pytest.approx(512) and work["r1"] == pytest.approx(5120)


# ------------------------------------------------- hot shared prompt at low load (the live bench's flood)
def _trace(records):
    from kvmesh.cluster.trace import Trace, TraceRequest

    return Trace("t", [TraceRequest.from_record(r) for r in records], 512)


def _run(policy, records, replicas):
    """Simulate `records` (512-token blocks); return (metrics, replica chosen per record)."""
    from kvmesh.cluster.simulator import SimConfig, simulate_policy

    placed = {}
    routed = policy.on_routed

    def record(request, replica_id, view=None):  # observe the decisions through the policy's own hook
        placed[int(request.request_id)] = replica_id
        routed(request, replica_id, view)

    policy.on_routed = record
    try:
        m = simulate_policy(_trace(records), SimConfig(replicas, 4000), policy)
    finally:
        del policy.on_routed
    return m, [placed[i] for i in range(len(records))]


def _flood():
    from kvmesh.cluster.workloads import synth_flood

    return synth_flood(requests=64, system_blocks=8, unique_blocks=2, interval_ms=50.0)[:48]  # the live bench's


def _chat(offset=0):
    from kvmesh.cluster.workloads import ChatSpec, synth_chat

    recs = synth_chat(ChatSpec(tenants=2, groups=2, users=4, turns=4, seed=0))[:48]
    return [dict(r, hash_ids=[h + offset for h in r["hash_ids"]]) for r in recs]


def test_kvmesh_spreads_a_shared_prompt_flood_at_low_load_within_002_of_the_bound():
    """48 requests sharing one system prompt, one at a time, on 2 replicas: the prompt is replicated once
    onto the second replica instead of every request going to one (prefill max/mean 2.0)."""
    from kvmesh.cluster.bounds import infinite_hit_rate

    recs = _flood()
    bound = infinite_hit_rate(_trace(recs).requests, 512)
    m, placed = _run(make_policy("kvmesh"), recs, 2)
    assert len(set(placed)) == 2
    assert m["imbalance"] <= 1.25, m["imbalance"]
    assert m["hit_rate_tokens"] >= bound - 0.02, (m["hit_rate_tokens"], bound)


def test_kvmesh_spreads_a_flood_that_follows_other_work():
    """The live bench runs workloads back to back on one router: the long-memory guard alone then
    tie-breaks the whole flood onto the replica with less past work (48/0). The short window does not."""
    from kvmesh.cluster.bounds import infinite_hit_rate

    flood = [dict(r, hash_ids=[h + 200_000 for h in r["hash_ids"]]) for r in _flood()]
    bound = infinite_hit_rate(_trace(flood).requests, 512)
    out = {}
    for fanout in (8, 10**9):  # the default, and with no prefix ever hot (no spread term)
        p = make_policy("kvmesh", hot_fanout=fanout)
        _run(p, _chat(), 2)
        _run(p, _chat(offset=100_000), 2)  # another chat run, disjoint blocks (the bench's reseed)
        out[fanout] = _run(p, flood, 2)
    m, placed = out[8]
    assert len(set(placed)) == 2 and m["imbalance"] <= 1.25, m["imbalance"]
    assert m["hit_rate_tokens"] >= bound - 0.02, (m["hit_rate_tokens"], bound)
    m0, placed0 = out[10**9]
    assert m0["imbalance"] > 1.5, m0["imbalance"]  # without the spread term the flood piles up (48/0 live)


def test_kvmesh_keeps_each_chat_user_on_one_replica():
    """Multi-turn users keep their history's replica: the spread applies to requests whose cached
    prefix ends at a fork (a shared prompt), never to a conversation's own history."""
    recs = _chat()
    m, placed = _run(make_policy("kvmesh"), recs, 2)
    by_user = {}
    for r, rid in zip(recs, placed):
        by_user.setdefault(r["user"], set()).add(rid)
    assert len(by_user) >= 8 and all(len(s) == 1 for s in by_user.values()), by_user
    assert len(set(placed)) == 2


def test_kvmesh_learns_forks_not_chains():
    import numpy as np

    p = make_policy("kvmesh", hot_fanout=3)
    system = [1, 2, 3]
    for u in range(3):  # three users branch after the system prompt; each continues its own chain
        for turn in range(1, 4):
            r = req(system + [100 * (u + 1) + t for t in range(turn)], rid=f"{u}-{turn}")
            p.rank(r, views(2))
            p.on_routed(r, "r0")
    assert p._is_hot(req(system + [999]), np.array([3, 0]))  # ends at the fork: hot
    assert not p._is_hot(req(system + [100, 101, 102, 7]), np.array([5, 0]))  # inside user 0's chain
    assert not p._is_hot(req([1, 2]), np.array([1, 0]))  # block 1 has one continuation
    assert not p._is_hot(req([50]), np.array([0, 0]))  # nothing cached anywhere


def test_kvmesh_rejects_bad_spread_parameters():
    for bad in (
        {"spread_weight": -1},
        {"half_life_requests": 0},
        {"hot_fanout": 1},
        {"hot_recompute_weight": -1},
        {"guard_weight": -1},
    ):
        with pytest.raises(ValueError):
            make_policy("kvmesh", **bad)


def test_kvmesh_unrouted_takes_back_exactly_the_credited_work():
    p = make_policy("kvmesh")
    r = req(range(10), rid="x")
    route(p, r, views(2), "r0")
    credited = p.recent_work()
    assert credited["r0"] > credited["r1"]
    p.on_unrouted(r, "r1")  # not where it was credited: nothing changes
    assert p.recent_work() == credited
    p.on_unrouted(r, "r0")
    route(p, r, views(2), "r1")
    moved = p.recent_work()
    assert moved["r0"] == pytest.approx(credited["r1"]) and moved["r1"] == pytest.approx(credited["r0"])


def test_kvmesh_soft_guard_moves_a_conversation_only_for_more_than_its_history():
    """The balance guard charges a replica's work above the bound like recompute: a conversation stays
    on its over-bound replica while the overshoot is smaller than the history it would recompute
    elsewhere; a shorter history, or a cold request, goes to the other replica."""
    p = make_policy("kvmesh")
    for i in range(20):  # r0 gets more than its share of cold work
        r = req([10_000 + 100 * i + k for k in range(15)], rid=f"w{i}")
        p.rank(r, views(2))
        p.on_routed(r, "r0" if i % 3 else "r1")
    work = p.recent_work()
    over = work["r0"] - 1.1 * (work["r0"] + work["r1"]) / 2
    assert 20 * BS < over < 40 * BS

    def first(blocks):
        vs = views(2, hbm_blocks={0: blocks}, host_blocks={0: blocks}, shared_blocks={0: blocks})
        return p.rank(req(list(range(blocks)) + [99]), vs)[0]

    assert first(40) == "r0"  # 40 blocks of history on r0: more than the overshoot, stays
    assert first(20) == "r1"  # 20 blocks: cheaper to recompute than to overload r0
    assert p.rank(req([77, 78, 79]), views(2))[0] == "r1"  # nothing cached anywhere


def test_kvmesh_ranking_again_changes_neither_the_order_nor_the_balance_state():
    """Serve may rank one request several times while it backs off; only routing may age or grow the
    policy's work windows, or a burst of re-ranks would shrink the recent work the spread sees."""
    p = make_policy("kvmesh")
    for i in range(40):  # a hot shared prompt (block 0..3) followed by many continuations, all on r0
        r = req([0, 1, 2, 3, 100 + i], rid=f"w{i}")
        p.rank(r, views(4, shared_blocks={0: 4}, host_blocks={0: 4}, hbm_blocks={0: 4}))
        p.on_routed(r, "r0")
    state = (p._w.copy(), p._s.copy(), p._total, p._s_total)
    vs = views(4, shared_blocks={0: 4}, host_blocks={0: 4}, hbm_blocks={0: 4})
    probe = req([0, 1, 2, 3, 999], rid="again")
    orders = [p.rank(probe, vs) for _ in range(5)]
    assert all(o == orders[0] for o in orders)
    assert (p._w == state[0]).all() and (p._s == state[1]).all()
    assert (p._total, p._s_total) == state[2:]
    p.on_routed(probe, orders[0][0])  # routing (once) is what ages the short window
    assert p._s_total < state[3] + probe.num_tokens


def test_kvmesh_a_request_routed_again_does_not_make_its_last_block_a_fork():
    """The live router commits each time Serve ranks a request (and withdraws the earlier commitment):
    the same request seen many times is one continuation, not a fork that would relax its next turn's
    affinity."""
    p = make_policy("kvmesh")
    turn1 = [7, 8, 9]
    for _ in range(12):  # Serve backing off: a fresh RequestInfo per ranking, the same request id
        r = req(turn1, rid="conv-1-turn-1")
        rid = p.rank(r, views(4))[0]
        p.on_routed(r, rid)
        p.on_unrouted(r, rid)
    r = req(turn1, rid="conv-1-turn-1")
    p.on_routed(r, p.rank(r, views(4))[0])
    assert p._fanout.get(9) is not True
    assert not p._is_hot(req(turn1 + [10, 11], rid="conv-1-turn-2"), np.array([3, 0, 0, 0]))


# Memoised lookups that ranking may fill: caches of pure functions of the state, not state; and the last
# ranking's scores, kept for decision traces (an output: nothing reads it back to rank).
_CACHES = {"_ids_key", "_ids_idx", "_members", "_points", "_owners", "last_scores"}


def _state(p) -> bytes:
    import pickle

    return pickle.dumps({k: v for k, v in vars(p).items() if k not in _CACHES})


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_ranking_is_pure_for_every_policy(name):
    """Serve may rank a request several times while it backs off: the same request on the same view
    ranks the same way each time and leaves the policy's state byte for byte as it was."""
    import random

    rng = random.Random(5)
    p = make_policy(name, seed=3)
    for i in range(30):  # some history, so trees, windows and counters are not empty
        vs = views(4, hbm_blocks={rng.randrange(4): rng.randrange(3)}, queued={rng.randrange(4): rng.randrange(3)})
        for v in vs:
            v.host_blocks = v.shared_blocks = v.hbm_blocks
        route(p, req([rng.randrange(3), rng.randrange(40), rng.randrange(40)], rid=f"h{i}"), vs)
    vs = views(4, hbm_blocks={1: 2}, host_blocks={1: 2}, shared_blocks={1: 2}, queued={2: 1})
    r = req([1, 2, 3, 4], rid="probe")
    before = _state(p)
    first = p.rank(r, vs)
    assert _state(p) == before
    assert p.rank(r, vs) == first and _state(p) == before


def test_kvmesh_copies_a_group_prompt_only_as_far_as_its_traffic_fills_replicas():
    """Seven groups, each with its own hot system prompt, one replica each (a seventh of the traffic):
    a group's next conversation stays on its prompt's replica even with a queue there, rather than
    copying the prompt onto an idle replica (which, done for every group, makes each replica compute
    every group's prompt). A flood, all the traffic on one prompt, is still copied (the flood tests)."""
    p = make_policy("kvmesh")
    sys_prompt = {g: [g * 1000 + k for k in range(1, 5)] for g in range(7)}
    for u in range(10):  # ten conversations per group start, interleaved: every prompt becomes a fork
        for g in range(7):
            p.on_routed(req(sys_prompt[g] + [g * 1000 + 100 + u], rid=f"{g}-{u}"), f"r{g}")
    fresh = req(sys_prompt[0] + [999], rid="new")
    shared = {i: 4 if i == 0 else 0 for i in range(7)}
    vs = views(7, hbm_blocks=shared, host_blocks=shared, shared_blocks=shared, pending_prefill_tokens={0: 20 * 2048})
    assert p._is_hot(fresh, np.array(list(shared.values())))
    assert p.rank(fresh, vs)[0] == "r0"


def test_kvmesh_holds_a_prompt_being_computed_on_an_idle_replica_rather_than_queue_behind_it():
    """A group's second member arrives while the first still computes their 8-block prompt on r0. Seen only as
    it is now, every other replica must compute the prompt again, so it would queue on r0; told that the
    prompt will be loadable everywhere once r0's prefill is stored (`FleetView.inflight_blocks`), it takes
    an idle replica and waits for that store, unless the wait costs more than recomputing."""
    p = make_policy("kvmesh")
    first = req(range(9), rid="a")
    route(p, first, views(4), rid="r0")
    second = req([*range(8), 99], rid="b")
    busy = {0: 8}
    vs = views(
        4, hbm_blocks=busy, host_blocks=busy, shared_blocks=busy, queued={0: 1}, pending_prefill_tokens={0: 9 * BS}
    )
    fleet = FleetView.from_views(vs)
    assert fleet.ids[p.place(second, fleet)[0]] == "r0"  # nothing in flight: stays with the prompt
    prefill_s = p.predict(first, views(1)[0])[0]
    fleet.inflight_blocks, fleet.inflight_ready_s = np.array([8, 8, 8, 8]), prefill_s
    ranked = [fleet.ids[k] for k in p.place(second, fleet)]
    assert ranked[0] != "r0" and p.best(second, fleet) == fleet.ids.index(ranked[0])
    assert p.hold_worth(8 * BS, prefill_s)
    # a wait longer than recomputing the prompt is worth: not held, back to r0
    fleet.inflight_ready_s = 31 * 8 * BS * p.cost.prefill_s_per_token
    assert not p.hold_worth(8 * BS, fleet.inflight_ready_s)
    assert fleet.ids[p.place(second, fleet)[0]] == "r0"
    # never holding: the fleet's in-flight prefix changes nothing
    q = make_policy("kvmesh", hold_for_tier=False)
    route(q, first, views(4), rid="r0")
    fleet.inflight_ready_s = prefill_s
    assert fleet.ids[q.place(second, fleet)[0]] == "r0"


def test_kvmesh_charges_a_request_whose_own_prefill_would_carry_its_replica_past_the_cap():
    """r1 holds a conversation's history and sits just within the guard's bound (1.10 x the mean), so the
    guard charges nothing there; the next turn's own 2 blocks would still carry r1 to 1.64 x the mean. With
    the history in the shared tier, the turn goes to the least-worked replica and loads it there; without
    the charge (`overshoot_weight=0`) it stays on r1, as the guard alone lets it."""

    def placed(**kw):
        p = make_policy("kvmesh", **kw)
        route(p, req(range(100, 104)), views(3), rid="r0")
        route(p, req(range(200, 204)), views(3), rid="r1")  # the conversation's first turn
        route(p, req(range(300, 303)), views(3), rid="r2")
        work = p.recent_work()
        mean = sum(work.values()) / 3
        assert work["r1"] <= (1 + p.balance_slack) * mean < work["r1"] + 2 * BS
        history = {0: 0, 1: 4, 2: 0}
        vs = views(3, hbm_blocks=history, host_blocks=history, shared_blocks={0: 4, 1: 4, 2: 4})
        return p.rank(req([*range(200, 204), 204, 205]), vs)[0]

    assert placed() == "r2"
    assert placed(overshoot_weight=0.0) == "r1"
    with pytest.raises(ValueError):
        make_policy("kvmesh", overshoot_cap=0.9)
