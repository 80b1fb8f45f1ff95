"""The balanced compute floor is a true lower bound (checked against every placement of small random
workloads), it proves the arithmetic of a shared prompt spread for balance, and it agrees with the
simulator: no policy meets the robustness target on a draw it proves out of reach."""

from __future__ import annotations

import itertools
import random

import pytest
from prefix_workloads import branching_requests

from kvmesh.cluster.exact_placement import replay_placement
from kvmesh.cluster.out_of_reach import balanced_compute_floor, target_out_of_reach
from kvmesh.cluster.sweep import SweepOptions, evaluate_draw, target_misses
from kvmesh.cluster.trace import TraceRequest
from kvmesh.cluster.workload_family import draw

BS = 4


@pytest.mark.parametrize("seed", range(12))
def test_no_placement_computes_less_than_the_floor_under_its_load(seed):
    rng = random.Random(seed)
    replicas = rng.choice([2, 3])
    requests = branching_requests(rng, rng.randint(4, 7), BS)
    placements = [
        replay_placement(requests, BS, replicas, p)["computed"]
        for p in itertools.product(range(replicas), repeat=len(requests))
    ]
    least = min(sum(w) for w in placements)
    for max_load in sorted({max(w) for w in placements}) + [min(max(w) for w in placements) - 1]:
        floor = balanced_compute_floor(requests, BS, replicas, max_load)
        fitting = [sum(w) for w in placements if max(w) <= max_load]
        if floor is None:
            assert not fitting, (max_load, fitting)  # None: proven that nothing fits
        elif fitting:
            assert min(fitting) >= floor, (max_load, floor, min(fitting))
    assert balanced_compute_floor(requests, BS, replicas, float("inf")) <= least


def test_a_shared_prompt_spread_for_balance_is_computed_on_several_replicas():
    """8 requests on 4 replicas, each a 4-block shared prompt, 4 private blocks and a 1-token tail (33
    tokens). Computed once: (4 + 32) blocks + 8 tails = 152 tokens. With at most 60 tokens per replica:
    below the prompt's last block are 8 x (4 blocks + tail) = 136 tokens, and each replica holding it has
    60 - 16 = 44 tokens of room, so ceil(136 / 44) = 4 replicas compute it, and so every block above it:
    floor = 4 x 4 x 4 + 136 = 200, which is what the best placement (two requests per replica) computes."""
    shared = [1, 2, 3, 4]
    reqs = [TraceRequest(float(i), 8 * BS + 1, 1, shared + [10 * i + k for k in range(10, 15)]) for i in range(8)]
    assert balanced_compute_floor(reqs, BS, 4, float("inf")) == 152
    assert balanced_compute_floor(reqs, BS, 4, 60) == 200
    prompt = 8 * 33
    # 170 computed allowed, so at most 1.25 * 170 / 4 = 53.1 per replica: the floor is then 200 > 170
    proof = target_out_of_reach(reqs, BS, 4, 1 - 170 / prompt, 1.25)
    assert proof["out_of_reach"] and proof["computed_floor"] == 200
    # the infinite-cache hit rate on one replica is not excluded (max/mean up to the replica count)
    assert not target_out_of_reach(reqs, BS, 4, 1 - 152 / prompt, 4.0)["out_of_reach"]


def test_a_request_larger_than_the_load_limit_fits_nowhere():
    reqs = [TraceRequest(0.0, 3 * BS + 3, 1, [1, 2, 3, 4])]
    assert balanced_compute_floor(reqs, BS, 2, 2) is None


@pytest.mark.parametrize("seed", [1001, 1003, 1015, 1023, 1045])
def test_no_policy_meets_the_robustness_target_on_a_draw_proven_out_of_reach(seed):
    opts = SweepOptions()
    row = evaluate_draw(draw(seed), opts=opts)
    met = [name for name in row["policies"] if not target_misses([row], name, opts.target_ratio, opts.target_imbalance)]
    proof = row["bounds"]["target_out_of_reach"]
    if proof:
        assert not met and not row["bounds"]["target_reachable"], met
    else:
        assert seed not in (1001, 1003, 1015)  # these three are proven out of reach


@pytest.mark.parametrize(
    "requests", [[], [TraceRequest(0.0, 0, 1, [1]), TraceRequest(1.0, 0, 1, [1])]], ids=["empty", "zero-token"]
)
def test_without_prompt_tokens_nothing_is_proved_out_of_reach(requests):
    """Every placement of a trace with no prompt token meets hit rate 0 at max/mean 1.0 (`replay_placement`);
    the floor had no load to spread (0 tokens allowed, max load 0) and read that as impossible."""
    assert replay_placement(requests, 4, 2, [0] * len(requests))["imbalance"] == 1.0
    assert not target_out_of_reach(requests, 4, 2, 0.0, 1.25)["out_of_reach"]
