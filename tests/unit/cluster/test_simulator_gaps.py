"""The one-router simulator with stores at prefill end and a shared tier: what a request run in a held
request's idle gap may be credited and take (`fit_in_gap`), what a bounded shared tier lets a request wait
for, and the stated optimism of the default `routed` stores."""

from __future__ import annotations

import dataclasses

import pytest
from sim_fakes import FixedPlacement

from kvmesh.cluster.bounds import balance_bounded_bound, infinite_hit_rate
from kvmesh.cluster.simulator import SimConfig, fit_in_gap, simulate_policy
from kvmesh.cluster.trace import Trace, TraceRequest
from kvmesh.policies.cost_model import CostModel

# 10 ms per computed token, nothing else: a prefill's length is its computed tokens x 0.01 s
COST = CostModel(
    prefill_s_per_token=0.01,
    prefill_base_s=0.0,
    decode_s_per_token=0.001,
    host_load_s_per_token=0.0,
    shared_load_s_per_token=0.0,
    max_batch=64,
)


def trace(*reqs, block_size=4):
    return Trace("gaps", [TraceRequest(*r) for r in reqs], block_size)


def computed(replicas: int, capacity: int = 100, cost: CostModel = COST, **kw) -> SimConfig:
    return SimConfig(replicas, capacity, shared=True, tier_store_at="computed", cost=cost, **kw)


def test_a_request_in_a_gap_is_not_credited_blocks_a_request_queued_behind_the_hold_computes():
    # P computes blocks 1-4 on r0 until 0.17 s; A is held on r1 for them from 0.01 s (idle gap 0.01-0.17);
    # X (0.17 s of prefill) does not fit that gap and runs after A, 0.22-0.39; B shares X's four blocks: they
    # exist on r1 only from 0.39 s, so B cannot run in the gap on them. Computing them does not fit the gap
    # either (0.21 s), so B runs after X, 0.39-0.44 (credited the 16 tokens then): TTFT 0.41, not 0.05.
    t = trace(
        (0, 17, 1, [1, 2, 3, 4, 5]),
        (10, 21, 1, [1, 2, 3, 4, 6, 7]),
        (20, 17, 1, [10, 11, 12, 13, 14]),
        (30, 21, 1, [10, 11, 12, 13, 15, 16]),
    )
    m = simulate_policy(t, computed(2), FixedPlacement([0, 1, 1, 1], hold=True))
    assert m["held_for_tier"] == 1
    assert m["hit_tokens_by_tier"]["hbm"] == 16
    assert m["ttft_p99_s"] == pytest.approx(0.41)
    assert m["ttft_mean_s"] == pytest.approx((0.17 + 0.21 + 0.37 + 0.41) / 4)


def test_a_request_in_a_gap_may_use_blocks_computed_earlier_in_that_gap():
    # A is held on r1 from 0.01 s to 0.40 s; G (blocks 10-11, 9 tokens) runs in the gap 0.02-0.11; H, sharing
    # G's two blocks, is sent at 0.03 s: it may start in the gap once they are computed, 0.11-0.12 (TTFT 0.09)
    t = trace(
        (0, 40, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9, 99]),
        (10, 41, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9, 98, 97]),
        (20, 9, 1, [10, 11, 12]),
        (30, 9, 1, [10, 11, 13]),
    )
    m = simulate_policy(t, computed(2), FixedPlacement([0, 1, 1, 1], hold=True))
    assert m["held_for_tier"] == 1
    assert m["hit_tokens_by_tier"]["hbm"] == 8
    # P 0.40, A 0.40 + 0.05 - 0.01, G 0.09, H 0.09
    assert m["ttft_mean_s"] == pytest.approx((0.40 + 0.44 + 0.09 + 0.09) / 4)


def test_a_request_in_a_gap_evicts_none_of_the_blocks_the_held_request_was_credited():
    # r1 holds 4 blocks. Q leaves blocks 1-2 there; A is credited them (hbm) and held on r1 from 0.11 s for
    # block 3, which P computes until 0.39 s; B (three new blocks) would fit the gap in time, but its blocks
    # evict two of A's before A starts: it waits its turn, 0.40-0.53, rather than running 0.12-0.25
    t = trace(
        (0, 9, 1, [1, 2, 90]),
        (100, 37, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9]),
        (110, 13, 1, [1, 2, 3, 92]),
        (120, 13, 1, [20, 21, 22, 93]),
    )
    m = simulate_policy(t, computed(2, capacity=4), FixedPlacement([1, 0, 1, 1], hold=True))
    assert m["held_for_tier"] == 1
    assert m["hit_tokens_by_tier"]["hbm"] == 8  # A's blocks 1-2, still there when it starts
    # Q 0.09, P 0.29, A 0.29, B 0.41
    assert m["ttft_p99_s"] == pytest.approx(0.41)
    assert m["ttft_mean_s"] == pytest.approx((0.09 + 0.29 + 0.29 + 0.41) / 4)


def test_a_request_in_a_gap_waits_for_a_sequence_slot():
    # max_batch 2. D1 and D2 decode on r1 until 0.12 s; A is held there from 0.02 s to 0.17 s (P computes its
    # prefix on r0). G (one token) sent at 0.03 s fits the gap in time but finds both slots taken until 0.12:
    # it starts then, 0.12-0.13 (TTFT 0.10), not at once beside D1 and D2
    cost = dataclasses.replace(COST, max_batch=2)
    t = trace(
        (0, 17, 1, [1, 2, 3, 4, 5]),
        (0, 1, 110, [40]),
        (0, 1, 100, [41]),
        (20, 21, 1, [1, 2, 3, 4, 6, 7]),
        (30, 1, 1, [50]),
    )
    m = simulate_policy(t, computed(2, cost=cost), FixedPlacement([0, 1, 1, 1, 1], hold=True))
    assert m["held_for_tier"] == 1
    # P 0.17, D1 0.01, D2 0.02, A 0.22 - 0.02, G 0.10
    assert m["ttft_mean_s"] == pytest.approx((0.17 + 0.01 + 0.02 + 0.20 + 0.10) / 5)


def test_fit_in_gap_counts_every_sequence_over_the_whole_span():
    from kvmesh.cluster.simulator import slots_free

    # a request starting at 1.0 (the held one) took the only slot without counting one run in the gap: a
    # gap request still decoding then does not fit; one done by then does
    assert fit_in_gap([(0.0, 1.0)], 0.0, 0.5, 0.0, [(5.0, 1.0)], 1, decode_s=1.0) is None
    assert fit_in_gap([(0.0, 1.0)], 0.0, 0.5, 0.0, [(5.0, 1.0)], 1, decode_s=0.4) == 0.0
    # a sequence decoding until 0.5 holds the only slot: the gap request starts when it ends
    gaps = [(0.0, 2.0)]
    assert fit_in_gap(gaps, 0.0, 0.5, 0.0, [(0.5, -1.0)], 1) == 0.5
    assert gaps == [(0.0, 0.5), (1.0, 2.0)]
    assert slots_free([(0.5, -1.0), (3.0, 1.0)], 0.5, 1.0, 1)  # half open: the slot freed at 0.5, taken at 1.0
    assert not slots_free([(0.5, -1.0), (3.0, 1.0)], 0.5, 1.01, 1)


def test_a_bounded_shared_tier_lets_a_request_wait_only_for_the_blocks_it_keeps():
    # P writes blocks 1-4 at 0.17 s to a shared tier of 2 blocks: it keeps blocks 1-2 (the write evicts its
    # own last blocks). A, held for them, is credited 8 tokens from the tier, not 16
    t = trace((0, 17, 1, [1, 2, 3, 4, 5]), (10, 21, 1, [1, 2, 3, 4, 6, 7]))
    m = simulate_policy(t, computed(2, shared_blocks=2), FixedPlacement([0, 1], hold=True))
    assert m["held_for_tier"] == 1
    assert m["hit_tokens_by_tier"]["shared"] == 8
    assert m["ttft_p99_s"] == pytest.approx(0.17 - 0.01 + 0.13)


def test_routed_stores_are_early_by_the_computing_requests_whole_ttft():
    # the documented bound of `tier_store_at="routed"`: r0 has 1.2 s of queue when P (blocks 1-4) is routed;
    # A on r1 loads P's blocks at once and is done 0.01 s after it arrives, 1.36 s before P has computed them
    big = [(0, 40, 1, [100 * i + k for k in range(10)]) for i in (1, 2, 3)]
    t = trace(*big, (1, 17, 1, [1, 2, 3, 4, 5]), (2, 17, 1, [1, 2, 3, 4, 6]))
    m = simulate_policy(t, SimConfig(2, 100, shared=True, cost=COST), FixedPlacement([0, 0, 0, 0, 1], hold=False))
    assert m["hit_tokens_by_tier"]["shared"] == 16
    assert m["per_replica"]["r1"]["prefill_tokens"] == 1
    assert m["ttft_p99_s"] == pytest.approx(1.369)  # P's TTFT: how early A's copy was


def test_balance_bounded_without_a_cap_is_one_infinite_cache_in_trace_order():
    # the second prompt is a prefix of the first: in trace order it hits 4 tokens; in the best order 8
    reqs = [TraceRequest(0, 9, 1, [1, 2, 3]), TraceRequest(1, 8, 1, [1, 2])]
    assert balance_bounded_bound(reqs, 4, 2, float("inf"))["hit_rate"] == pytest.approx(4 / 17)
    assert infinite_hit_rate(reqs, 4) == pytest.approx(8 / 17)
