"""The fleet with R routers (cluster/multi_router.py): the one-router case is the plain simulator, sync
with no delay makes R routers one, routers without sync split a prefix, and replica churn keeps every
per-replica structure at the fleet's size."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvmesh.cluster.multi_router import RouterSetup, simulate_routers
from kvmesh.cluster.simulator import ClosedLoop, SimConfig, arrivals_for, simulate_policy
from kvmesh.cluster.trace import load_trace
from kvmesh.cluster.workloads import ChatSpec, engine_trace, synth_chat
from kvmesh.policies.base import FleetView, RequestInfo
from kvmesh.policies.cost_model import CostModel
from kvmesh.policies.registry import make_policy

COST = CostModel(prefill_s_per_token=0.001, prefill_base_s=0.01, decode_s_per_token=0.0005, max_batch=8)


def chat(users: int = 6, turns: int = 4):
    records = synth_chat(ChatSpec(tenants=2, groups=2, users=users, turns=turns, start_spread_ms=2000, think_ms=500))
    return engine_trace(records, 32, name="chat")


def comparable(m: dict, *skip: str) -> dict:
    return {k: v for k, v in m.items() if k not in ("sim_wall_s", "routers", *skip)}


@pytest.fixture(scope="module")
def trace():
    return chat()


def cfg() -> SimConfig:
    return SimConfig(6, 60, cost=COST, load=0.9)


def kvmesh():
    return make_policy("kvmesh", cost=COST)


def test_one_router_without_delay_is_the_plain_simulator(trace):
    plain = simulate_policy(trace, cfg(), kvmesh())
    one = simulate_routers(trace, cfg(), kvmesh, RouterSetup(1, 0.0))
    assert one["hit_rate_tokens"] > 0.3  # a workload with reuse, so equality says something
    assert comparable(one) == comparable(plain)


def test_one_router_is_the_plain_simulator_when_prompts_overflow_the_cache(trace):
    """Prompts of up to 21 blocks on caches of 16: the replica keeps each one's first 16 blocks, and the
    router's index (`index_stats` included) holds those only, as the plain simulator's does."""
    small = SimConfig(6, 16, cost=COST, load=0.9)
    assert max(len(r.hash_ids) for r in trace.requests) > small.capacity_blocks
    plain = simulate_policy(trace, small, kvmesh())
    one = simulate_routers(trace, small, kvmesh, RouterSetup(1, 0.0))
    assert one["hit_rate_tokens"] > 0.1
    assert comparable(one) == comparable(plain)
    # with a bounded shared tier too: the last request's tier stores reach the router's index after it
    tiered = SimConfig(6, 16, cost=COST, load=0.9, shared=True, shared_blocks=120)
    plain = simulate_policy(trace, tiered, kvmesh())
    one = simulate_routers(trace, tiered, kvmesh, RouterSetup(1, 0.0))
    assert plain["hit_tokens_by_tier"]["shared"] > 0
    assert comparable(one) == comparable(plain)
    # and the smallest case: one 5-block prompt on a 4-block cache, then a prompt whose blocks only the
    # shared tier keeps when the run ends
    tiny = load_like([(0, 20, 1, [1, 2, 3, 4, 5]), (1, 8, 1, [1, 2]), (2, 8, 1, [7, 8])])
    for shared in (False, True):
        plain = simulate_policy(tiny, SimConfig(1, 4, shared=shared), make_policy("round_robin"))
        one = simulate_routers(
            tiny, SimConfig(1, 4, shared=shared), lambda: make_policy("round_robin"), RouterSetup(1, 0.0)
        )
        assert plain["index_stats"]["admissions"] == (7 if shared else 6)
        assert comparable(one) == comparable(plain)


def load_like(rows, block_size: int = 4):
    from kvmesh.cluster.trace import Trace, TraceRequest

    return Trace("rows", [TraceRequest(*r) for r in rows], block_size)


def test_synced_routers_without_delay_act_as_one(trace):
    plain = simulate_policy(trace, cfg(), kvmesh())
    four = simulate_routers(trace, cfg(), kvmesh, RouterSetup(4, 0.0, sync=True))
    # index_stats count each router's own lookups: a quarter each
    assert comparable(four, "index_stats") == comparable(plain, "index_stats")


def test_routers_send_as_the_plain_simulators_client_does():
    """With a client that sends a user's next turn only after its previous reply (here every turn is
    stamped before the previous reply can end), one router is still the plain simulator field by field,
    and so are four synced routers with no delay."""
    records = synth_chat(ChatSpec(tenants=2, groups=2, users=4, turns=4, start_spread_ms=200, think_ms=20))
    trace = engine_trace(records, 32, name="chat")
    users = [r["user"] for r in records]
    stamps = SimConfig(6, 60, cost=COST)  # the trace's own timestamps: turns 10-30 ms apart
    arrivals, _ = arrivals_for(trace, stamps)
    client = ClosedLoop.timed(arrivals, users)
    plain = simulate_policy(trace, stamps, kvmesh(), client=client)
    stamped = simulate_policy(trace, stamps, kvmesh())
    # sent at their stamps, turns queue behind their own previous turn
    assert plain["ttft_p90_s"] < 0.5 * stamped["ttft_p90_s"]
    one = simulate_routers(trace, stamps, kvmesh, RouterSetup(1, 0.0), client=client)
    four = simulate_routers(trace, stamps, kvmesh, RouterSetup(4, 0.0, sync=True), client=client)
    assert comparable(one, "held_for_tier") == comparable(plain, "held_for_tier")
    assert comparable(four, "index_stats", "held_for_tier") == comparable(plain, "index_stats", "held_for_tier")


def test_routers_without_sync_split_a_prefix():
    """Router 1 never hears where router 0 put a conversation: with a long delay its turns land on
    replicas that lack the history, so the hit rate drops; sync (no delay) restores it."""
    trace = chat(users=4, turns=6)
    one = simulate_routers(trace, cfg(), kvmesh, RouterSetup(1, 0.0))
    blind = simulate_routers(trace, cfg(), kvmesh, RouterSetup(2, 5.0, sync=False))
    synced = simulate_routers(trace, cfg(), kvmesh, RouterSetup(2, 0.0, sync=True))
    assert blind["hit_rate_tokens"] < one["hit_rate_tokens"] - 0.02
    assert synced["hit_rate_tokens"] == one["hit_rate_tokens"]


def test_sync_lets_routers_balance_the_whole_fleet():
    """Without sync each router balances only its own traffic; the peers' decisions, delivered, are
    credited by the same Policy.on_routed (so with sync the routers' guard work agrees)."""
    made = []

    def factory():
        made.append(kvmesh())
        return made[-1]

    trace = chat(users=3, turns=3)
    simulate_routers(trace, cfg(), factory, RouterSetup(3, 0.0, sync=True))
    synced = [p.recent_work() for p in made]
    made.clear()
    simulate_routers(trace, cfg(), factory, RouterSetup(3, 0.0, sync=False))
    blind = [p.recent_work() for p in made]
    # synced, each router credits (nearly: the last decisions are still in flight) the whole fleet's work
    assert sum(blind[0].values()) < 0.5 * sum(synced[0].values())
    assert min(sum(w.values()) for w in synced) > 0.9 * max(sum(w.values()) for w in synced)


def test_synced_routers_with_delay_keep_the_single_router_hit_rate(monkeypatch):
    """16 synced routers hearing each other 100 ms late, on the bundled synthetic trace at the bench's
    fleet size (256 replicas, load 0.8): each router counts the placements it has not heard of yet and
    spreads new prefixes accordingly, so the hit rate stays within 3% of one router's (measured: 0.977-0.984
    of it over five policy seeds). Without that count they share one stale view and send each window's
    new prefixes to the one replica it ranks first (0.80-0.82 of it, and p90 TTFT five times as long)."""
    from kvmesh.deployments.peer_lag import UnseenPlacements

    trace = load_trace("synthetic")
    fleet = SimConfig(256, 4000, load=0.8)
    one = simulate_routers(trace, fleet, lambda: make_policy("kvmesh"), RouterSetup(1, 0.1))["hit_rate_tokens"]
    many = simulate_routers(trace, fleet, lambda: make_policy("kvmesh"), RouterSetup(16, 0.1, sync=True))
    assert many["hit_rate_tokens"] >= 0.97 * one
    monkeypatch.setattr(UnseenPlacements, "estimate", lambda self, now: (0.0, 0.0))
    herd = simulate_routers(trace, fleet, lambda: make_policy("kvmesh"), RouterSetup(16, 0.1, sync=True))
    assert herd["hit_rate_tokens"] < 0.9 * one
    assert herd["ttft_p90_s"] > 2 * many["ttft_p90_s"]


def test_replica_churn_keeps_per_replica_state_bounded(trace):
    made = []

    def factory():
        made.append(kvmesh())
        return made[-1]

    out = simulate_routers(trace, cfg(), factory, RouterSetup(2, 0.01, churn_every_s=0.02))
    replaced = out["routers"]["replicas_replaced"]
    assert replaced >= 3 * cfg().replicas  # every replica replaced several times
    assert out["routers"]["index_slots"] == cfg().replicas
    for p in made:
        assert len(p.recent_work()) == cfg().replicas
        assert len(p._w) == cfg().replicas  # slots of departed replicas are reused
    assert len(out["per_replica"]) == cfg().replicas


def test_a_replacement_takes_over_its_predecessors_accelerator():
    """The capacity model is one accelerator per replica: a replica replaced while its queue drains must not
    serve beside it on a second one, which under fast churn read as utilisation above 1."""
    busy = SimConfig(2, 60, cost=COST, load=3.0)  # overloaded: every replica has a queue when it is replaced
    trace = chat(users=10, turns=4)
    still = simulate_routers(trace, busy, kvmesh, RouterSetup(2, 0.0))
    churn = simulate_routers(trace, busy, kvmesh, RouterSetup(2, 0.0, churn_every_s=0.05))
    assert churn["routers"]["replicas_replaced"] > 20
    assert still["utilization"] > 0.8
    assert churn["utilization"] <= 1.0 + 1e-9
    # cold caches compute more, on the same accelerators: the fleet cannot finish sooner
    assert churn["hit_rate_tokens"] < still["hit_rate_tokens"]
    assert churn["throughput_tokens_s"] <= 1.02 * still["throughput_tokens_s"]


def test_the_routers_see_a_replacements_accelerator_busy_with_its_predecessors_work():
    """The work the departing replica accepted runs on before the newcomer's: ranked as idle, the newcomer
    drew requests that then waited behind it."""
    seen = []

    class Recording(type(kvmesh())):
        def on_routed(self, request, replica_id, view=None):
            if "." in replica_id and view is not None:  # a replacement (`r<slot>.<n>`)
                seen.append(view.queued + view.pending_prefill_tokens)
            return super().on_routed(request, replica_id, view)

    busy = SimConfig(2, 60, cost=COST, load=3.0)
    simulate_routers(
        chat(users=10, turns=4), busy, lambda: Recording(cost=COST), RouterSetup(1, 0.0, churn_every_s=0.05)
    )
    assert len(seen) > 20
    assert sum(1 for load in seen if load > 0) > len(seen) / 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("closed_loop", [False, True])
def test_a_churn_interval_far_below_the_gaps_between_requests_replaces_each_replica_once_per_gap(trace, closed_loop):
    """1e-300 s looped span / interval times (for ever): between two requests only the last churn of each
    replica leaves a trace, so they are counted and the rest skipped; a quiet trace churning every minute runs."""
    import time

    client = ClosedLoop(3, trace.meta["users"]) if closed_loop else None
    started = time.monotonic()
    res = simulate_routers(trace, cfg(), kvmesh, RouterSetup(2, 0.01, churn_every_s=1e-300), client=client)
    assert time.monotonic() - started < 60
    assert res["routers"]["replicas_replaced"] > 10**250  # every churn due is counted


def test_a_churn_interval_below_the_clocks_resolution_replaces_each_replica_at_most_once_between_requests():
    """1e-300 s never moves the next churn time on: the loop's own bound stops it after one round of the fleet."""
    removed: list[list[str]] = [[]]

    class Recording(type(make_policy("round_robin"))):
        def on_replica_removed(self, rid):
            removed[-1].append(rid.split(".")[0])
            return super().on_replica_removed(rid)

        def best(self, req, fleet):
            removed.append([])
            return super().best(req, fleet)

    rows = [(0, 8, 1, [1, 2]), (1000, 8, 1, [3, 4]), (2000, 8, 1, [5, 6])]
    res = simulate_routers(load_like(rows), SimConfig(3, 10), Recording, RouterSetup(1, 0.0, churn_every_s=1e-300))
    between = removed[1:-1]  # before the second request, before the third
    assert [sorted(slots) for slots in between] == [["r0", "r1", "r2"]] * 2
    assert res["routers"]["replicas_replaced"] > 10**250


def test_best_is_the_first_of_place():
    """The simulator asks only for the best replica; it must be `place`'s first choice."""
    rng = np.random.default_rng(0)
    p = kvmesh()
    n = 16
    ids = [f"r{i}" for i in range(n)]
    for i in range(60):
        shared = rng.integers(0, 4, n) * rng.integers(0, 2, n)
        fleet = FleetView(
            ids,
            np.minimum(shared, rng.integers(0, 4, n)),
            shared,
            shared,
            rng.integers(0, 3, n),
            rng.integers(0, 10, n),
            np.zeros(n),
            rng.integers(0, 2, n) * 100,
            np.full(n, 100),
        )
        req = RequestInfo(list(range(100 * i, 100 * i + 4)), 4 * 32 + 5, 32, request_id=str(i))
        assert p.best(req, fleet) == p.place(req, fleet)[0]
        p.on_routed(req, ids[p.best(req, fleet)], fleet.view(0))
    hard = copy.deepcopy(p)
    hard.guard_weight = None
    assert hard.best(req, fleet) == hard.place(req, fleet)[0]


@pytest.mark.parametrize("name", ["llmd_precise", "dynamo_cost"])
def test_a_policy_reading_engine_signals_this_model_does_not_keep_is_refused(name):
    """llm-d and Dynamo read the engine's waiting queue and allocated KV, or Dynamo's booked blocks, which only
    the one-router simulator keeps: here they would place on other inputs without a word."""
    from kvmesh.cluster.multi_router import RouterSetup, simulate_routers
    from kvmesh.cluster.simulator import SimConfig
    from kvmesh.cluster.trace import load_trace
    from kvmesh.policies.registry import make_policy

    with pytest.raises(ValueError, match="does not model"):
        simulate_routers(load_trace("conversation"), SimConfig(2, 100), lambda: make_policy(name), RouterSetup(2))
