"""The shared-tier proof is sound (no placement the simulator runs with a shared tier, holding or not,
meets a target it calls out of reach, on every placement of small random workloads), and it proves what
one large request or the order of arrival rules out."""

from __future__ import annotations

import itertools
import random

import pytest
from prefix_workloads import branching_requests
from sim_fakes import COST, FixedPlacement

from kvmesh.cluster.simulator import SimConfig, simulate_policy
from kvmesh.cluster.sweep import prefill_max_over_mean
from kvmesh.cluster.tier_reach import tier_target_out_of_reach
from kvmesh.cluster.trace import Trace, TraceRequest

BS = 4


def pareto(points):
    """The (hit, imbalance) pairs no other pair beats on both."""
    return [p for p in points if not any(q != p and q[0] >= p[0] and q[1] <= p[1] for q in points)]


@pytest.mark.parametrize("seed", range(8))
def test_no_simulated_placement_meets_a_target_the_proof_rules_out(seed):
    rng = random.Random(seed)
    replicas = rng.choice([2, 3])
    requests = branching_requests(rng, rng.randint(4, 6), BS)
    trace = Trace("t", requests, BS)
    cfg = SimConfig(replicas, 1000, shared=True, tier_store_at="computed", cost=COST)
    got = set()
    for order in itertools.product(range(replicas), repeat=len(requests)):
        for hold in (False, True):
            m = simulate_policy(trace, cfg, FixedPlacement(order, hold))
            got.add((round(m["hit_rate_tokens"], 9), round(prefill_max_over_mean(m["per_replica"]), 9)))
    for hit, imbalance in pareto(got):
        res = tier_target_out_of_reach(requests, BS, replicas, hit * (1 - 1e-9), imbalance * (1 + 1e-9))
        assert res["verdict"] != "out of reach", (hit, imbalance, res)


def shared_prompt(big_first: bool) -> list[TraceRequest]:
    """A 10-block prompt P: one request adds 5 blocks of its own, three add 1; all end one token into a block."""
    p = list(range(1, 11))
    big = (61, p + [20, 21, 22, 23, 24, 25])
    small = [(45, p + [30 + k, 40 + k]) for k in range(3)]
    rows = [big, *small] if big_first else [small[0], big, *small[1:]]
    return [TraceRequest(float(k), n, 1, ids) for k, (n, ids) in enumerate(rows)]


def test_the_first_request_through_a_prompt_computes_it():
    # computed at best: P 40 + the big request's own 21 + 3 x 5 = 76 tokens of 196; max/mean 1.25 on 2
    # replicas allows 47.5 each. Arriving first, the big request computes P too (61): out of reach. Arriving
    # after a small one (that computes P, 45), it is not.
    hit = (196 - 76) / 196
    first = tier_target_out_of_reach(shared_prompt(True), BS, 2, hit * (1 - 1e-9), 1.25)
    assert first["verdict"] == "out of reach" and first["by"] == "solver"
    assert tier_target_out_of_reach(shared_prompt(False), BS, 2, hit * (1 - 1e-9), 1.25)["verdict"] == "not excluded"
    # sent by the closed-loop client: the big request as the second turn of the first small one's user
    users = ["a", "a", "b", "c"]
    assert tier_target_out_of_reach(shared_prompt(False), BS, 2, hit * (1 - 1e-9), 1.25, users=users)["verdict"] == (
        "not excluded"
    )
    # as every user's first request, the big one (first in the trace) is sent first
    users = ["a", "b", "c", "d"]
    assert tier_target_out_of_reach(shared_prompt(True), BS, 2, hit * (1 - 1e-9), 1.25, users=users)["verdict"] == (
        "out of reach"
    )


def test_sent_at_trace_times_a_later_turn_first_in_the_trace_may_be_sent_after_another_users_request():
    # an unrelated opening request of user a, then the big request as a's second turn, then three small ones:
    # first through P in the trace, the big request waits for a's first reply, so a small one may compute P
    reqs = [TraceRequest(0.0, 5, 1, [90, 91]), *shared_prompt(True)]
    reqs = [TraceRequest(float(k), r.input_length, 1, r.hash_ids) for k, r in enumerate(reqs)]
    hit = (201 - 81) / 201  # the unrelated request's 5 tokens are computed too
    users = ["a", "a", "b", "c", "d"]
    assert tier_target_out_of_reach(reqs, BS, 2, hit * (1 - 1e-9), 1.25)["verdict"] == "out of reach"
    timed = tier_target_out_of_reach(reqs, BS, 2, hit * (1 - 1e-9), 1.25, users=users, timed=True)
    assert timed["verdict"] == "not excluded"
    # as the opening request of its own user, it is sent at its time, first: out of reach again
    users = ["a", "e", "b", "c", "d"]
    timed = tier_target_out_of_reach(reqs, BS, 2, hit * (1 - 1e-9), 1.25, users=users, timed=True)
    assert timed["verdict"] == "out of reach"


def test_a_request_larger_than_any_replica_may_compute_is_out_of_reach():
    reqs = [TraceRequest(0.0, 1001, 1, list(range(1, 252)))] + [
        TraceRequest(float(k), 50, 1, list(range(1000 * k, 1000 * k + 13))) for k in range(1, 4)
    ]
    res = tier_target_out_of_reach(reqs, BS, 2, 0.0, 1.25)  # nothing shared: every token is computed
    assert res["verdict"] == "out of reach" and res["by"] == "one request"
    assert res["largest_request"] == 1001 and res["max_load"] == pytest.approx(1.25 * 1151 / 2)
