"""The exact placement solver agrees with every placement of small random workloads: its optimum is the
best placement within the balance limit, its bound is never above it, and its verdict on a target
(reachable / out of reach) is what enumerating every placement says."""

from __future__ import annotations

import itertools
import random

import pytest
from prefix_workloads import branching_requests

from kvmesh.cluster.exact_placement import best_balanced_placement, decide_target, replay_placement
from kvmesh.cluster.sweep import SweepOptions, decide_exactly, evaluate_draw, target_misses
from kvmesh.cluster.trace import TraceRequest
from kvmesh.cluster.workload_family import draw

BS = 4


def _every_placement(requests, replicas):
    for p in itertools.product(range(replicas), repeat=len(requests)):
        yield p, replay_placement(requests, BS, replicas, p)


@pytest.mark.parametrize("seed", range(10))
def test_the_solver_finds_the_best_placement_within_the_balance_limit(seed):
    rng = random.Random(seed)
    replicas = rng.choice([2, 3])
    requests = branching_requests(rng, rng.randint(4, 7), BS, aligned=False)
    limit = rng.choice([1.1, 1.25, 1.5])
    within = [
        sum(got["computed"]) for _, got in _every_placement(requests, replicas) if got["imbalance"] <= limit + 1e-9
    ]
    res = best_balanced_placement(requests, BS, replicas, limit)
    assert res["optimal"]
    if not within:
        assert res["placement"] is None
        return
    got = replay_placement(requests, BS, replicas, res["placement"])
    assert got["imbalance"] <= limit + 1e-9
    assert sum(got["computed"]) == min(within) == pytest.approx(res["computed_lower"])


@pytest.mark.parametrize("seed", range(10))
def test_with_prompts_ending_on_a_block_boundary_the_bound_stays_a_bound(seed):
    """Such a prompt recomputes its last block even where it is cached; the model counts it once per
    replica and widens the balance limit by as much, so its optimum is never above the best placement."""
    rng = random.Random(seed)
    replicas = rng.choice([2, 3])
    requests = branching_requests(rng, rng.randint(4, 7), BS)
    limit = rng.choice([1.1, 1.25, 1.5])
    within = [
        sum(got["computed"]) for _, got in _every_placement(requests, replicas) if got["imbalance"] <= limit + 1e-9
    ]
    res = best_balanced_placement(requests, BS, replicas, limit)
    if within:
        assert res["computed_lower"] <= min(within) + 1e-6


@pytest.mark.parametrize("seed", range(10, 22))
def test_the_verdict_on_a_target_is_what_every_placement_says(seed):
    """The best hit rate any placement reaches within the limit is reachable; half a token more is out of
    reach. With prompts ending on a block boundary (odd seeds) a verdict may be "undecided", never wrong."""
    rng = random.Random(seed)
    replicas = rng.choice([2, 3])
    exact = seed % 2 == 0
    requests = branching_requests(rng, rng.randint(4, 7), BS, aligned=not exact)
    limit = rng.choice([1.1, 1.25])
    prompt = sum(r.input_length for r in requests)
    runs = [got for _, got in _every_placement(requests, replicas)]
    within = [got["hit_rate"] for got in runs if got["imbalance"] <= limit + 1e-9]
    best = max(within, default=0.0)
    for hit_rate in (best, best + 0.5 / prompt):
        reachable = any(h >= hit_rate - 1e-12 for h in within)
        res = decide_target(requests, BS, replicas, hit_rate, limit)
        if exact:
            assert res["verdict"] == ("reachable" if reachable else "out of reach")
        else:
            assert res["verdict"] == "undecided" or (res["verdict"] == "reachable") == reachable
        if res["verdict"] == "reachable":
            got = res["replayed"]
            assert got["hit_rate"] >= hit_rate - 1e-12 and got["imbalance"] <= limit + 1e-9


def test_a_placement_exactly_at_its_own_balance_and_hit_rate_is_reachable():
    """Placement [0, 1, 2] computes 11, 14 and 9 tokens: max/mean 14 / (34 / 3), read back as
    1.2352941176470587, gives a per-replica limit of 13.999999999999998 tokens, and the budget its hit rate
    allows comes back from float the same way. The solver's cuts (`balanced_hosts` at that load, the
    computed-token row) must allow what the replay check allows, or the placement is "proved" out of reach."""
    reqs = [TraceRequest(0.0, 11, 1, [1, 2, 3]), TraceRequest(1.0, 14, 1, [1, 2, 3, 4])]
    reqs.append(TraceRequest(2.0, 9, 1, [8, 9, 10]))
    got = replay_placement(reqs, BS, 3, [0, 1, 2])
    assert got["computed"] == [11, 14, 9] and got["imbalance"] * 34 / 3 < 14
    res = decide_target(reqs, BS, 3, got["hit_rate"], got["imbalance"])
    assert res["verdict"] == "reachable" and res["replayed"]["computed"] == [11, 14, 9]
    for symmetry in ("first use", "loads"):
        found = best_balanced_placement(reqs, BS, 3, got["imbalance"], 5.0, 34, symmetry=symmetry)
        assert found["status"] != "Infeasible" and found["computed_lower"] <= 34 * (1 + 1e-9), symmetry


def test_one_shared_prompt_spread_for_balance():
    """8 requests on 4 replicas, each a 4-block shared prompt, 4 private blocks and a 1-token tail (33
    tokens, 264 in all). Computed once, 152 tokens, all on one replica (max/mean 4). Within max/mean 1.25
    every replica runs two requests and computes the prompt: 4 x 16 + 136 = 200, a hit rate of 64/264."""
    shared = [1, 2, 3, 4]
    reqs = [TraceRequest(float(i), 8 * BS + 1, 1, shared + [10 * i + k for k in range(10, 15)]) for i in range(8)]
    res = best_balanced_placement(reqs, BS, 4, 1.25)
    assert res["optimal"] and res["computed_lower"] == pytest.approx(200)
    assert sorted(replay_placement(reqs, BS, 4, res["placement"])["computed"]) == [50, 50, 50, 50]
    assert decide_target(reqs, BS, 4, 64 / 264, 1.25)["verdict"] == "reachable"
    assert decide_target(reqs, BS, 4, 65 / 264, 1.25)["verdict"] == "out of reach"
    assert decide_target(reqs, BS, 4, 112 / 264, 4.0)["verdict"] == "reachable"  # all on one replica


def test_replay_counts_what_the_simulator_counts():
    """A prompt hits whole blocks of its replica's cache, never its last token: 9 tokens with 2 blocks held
    computes 1; 8 tokens with both of its blocks held still computes its last block."""
    a = TraceRequest(0.0, 9, 1, [1, 2, 3])
    b = TraceRequest(1.0, 9, 1, [1, 2, 3])
    c = TraceRequest(2.0, 8, 1, [1, 2])
    got = replay_placement([a, b, c], BS, 2, [0, 0, 0])
    assert got["computed"] == [9 + 1 + 4, 0]
    assert got["hit_rate"] == pytest.approx((8 + 4) / 26)


def test_on_draws_the_solver_settles_misses_the_floor_leaves_open():
    """Eval draw 2073: the floor does not prove it, the solver does, and no policy meets the target there.
    Eval draw 2064: kvmesh misses it, and the solver finds a placement that meets it (the policy's miss)."""
    opts = SweepOptions()
    out = evaluate_draw(draw(2073), opts=opts)
    assert not out["bounds"]["target_out_of_reach"]
    assert decide_exactly(out, opts, 120)["bounds"]["exact_verdict"] == "out of reach"
    assert all(target_misses([out], name, opts.target_ratio, opts.target_imbalance) for name in out["policies"])
    row = evaluate_draw(draw(2064), opts=opts)
    assert target_misses([row], "kvmesh", opts.target_ratio, opts.target_imbalance)
    b = decide_exactly(row, opts, 120)["bounds"]
    assert b["exact_verdict"] == "reachable"
    assert b["exact_hit_over_merged"] >= opts.target_ratio and b["exact_imbalance"] <= opts.target_imbalance
