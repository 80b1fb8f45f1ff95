"""kvmesh policy: per-replica state under autoscaling churn (replicas that come and go)."""

from __future__ import annotations

import pytest

from kvmesh.policies.base import ReplicaView, RequestInfo
from kvmesh.policies.registry import make_policy

BS = 512


def _route(policy, replica_ids: list[str], i: int) -> str:
    """Rank one fresh request over `replica_ids` and credit it to the first choice, as the router does."""
    views = [ReplicaView(rid, capacity_blocks=1000) for rid in replica_ids]
    for rid in replica_ids:
        policy.on_replica_added(rid)
    request = RequestInfo([10_000 + i, 20_000 + i], 2 * BS, BS, 10, None, str(i))
    chosen = policy.rank(request, views)[0]
    policy.on_routed(request, chosen, next(v for v in views if v.replica_id == chosen))
    return chosen


def test_per_replica_arrays_do_not_grow_with_every_replica_id_ever_seen():
    p = make_policy("kvmesh")
    fleet = ["r0", "r1", "r2"]
    for gen in range(200):  # 200 scale-up/scale-down cycles, each with a new replica id
        newcomer = f"scaled-{gen}"
        _route(p, [*fleet, newcomer], gen)
        p.on_replica_removed(newcomer)
    assert len(p._w) <= 4 and len(p._s) <= 4
    assert set(p.recent_work()) == set(fleet)


def test_a_fleet_added_a_replica_at_a_time_grows_its_arrays_by_doubling_and_a_copy_keeps_its_own():
    """Copying the arrays on every replica added is quadratic in the fleet (100,000 replicas: 8 s)."""
    import copy

    p = make_policy("kvmesh")
    buffers = set()
    for i in range(1000):
        p.on_replica_added(f"r{i}")
        p.on_routed(RequestInfo([i], BS, BS, 10, None, f"q{i}"), f"r{i}")
        buffers.add(id(p._w_buf))
    assert len(buffers) <= 8  # 8, 16, ... 1024: one per doubling
    assert len(p._w) == len(p._s) == 1000 and (p._w > 0).all()
    twin = copy.deepcopy(p)  # the simulator's fresh policies are copies
    p.on_replica_added("extra")
    twin.on_routed(RequestInfo([7], BS, BS, 10, None, "t"), "r0")
    twin.on_replica_added("extra-twin")
    assert p.recent_work()["r0"] < twin.recent_work()["r0"]  # the copy's writes are its own
    assert twin.recent_work()["r999"] == pytest.approx(p.recent_work()["r999"])
    assert p._total == pytest.approx(sum(p.recent_work().values()))
    assert twin._total == pytest.approx(sum(twin.recent_work().values()))


def test_a_recycled_slot_starts_at_the_mean_not_at_its_previous_owners_work():
    p = make_policy("kvmesh")
    for i in range(30):
        _route(p, ["r0", "r1", "old"], i)
    p.on_routed(RequestInfo([1, 2, 3], 3 * BS, BS, 10, None, "big"), "old")  # "old" holds the most work
    p.on_replica_removed("old")
    work = p.recent_work()
    mean = sum(work.values()) / len(work)
    p.on_replica_added("new")
    assert p.recent_work()["new"] == pytest.approx(mean)
    # the fleet total counts the newcomer once, at the mean: the balance guard sees a fleet of three
    assert p._total == pytest.approx(sum(p.recent_work().values()))


def test_a_request_committed_again_ages_the_short_window_and_counts_its_fork_once():
    """Serve ranks a waiting request again and again; the router withdraws each commit before the next.
    The policy then holds what one commit to the last replica leaves: the same recent work, decay and fork
    counts, not one aging and one fork request per attempt."""
    import copy

    import numpy as np

    shared = [1, 2, 3]
    p = make_policy("kvmesh", half_life_requests=2.0)
    for rid in ("r0", "r1"):
        p.on_replica_added(rid)
    for i in range(10):  # ten requests branch off one prompt: a fork
        p.on_routed(RequestInfo([*shared, 100 + i], 4 * BS, BS, 10, None, f"g{i}"), f"r{i % 2}")
    waiting = RequestInfo([*shared, 999], 4 * BS, BS, 10, None, "waits")
    once = copy.deepcopy(p)
    once.on_routed(waiting, "r1")
    for attempt in range(5):
        p.on_routed(waiting, "r0")
        p.on_unrouted(waiting, "r0")
    p.on_routed(waiting, "r1")
    assert np.allclose(p._s, once._s) and p._s_total == pytest.approx(once._s_total)
    assert np.allclose(p._w, once._w)
    assert p._fork_total == pytest.approx(once._fork_total)
    fork = shared[-1]
    assert p._fork_count[fork] * p._fork_k == pytest.approx(once._fork_count[fork] * once._fork_k)


def test_a_commit_withdrawn_after_thousands_of_others_is_taken_back():
    """The live router may withdraw a commit (the request went elsewhere, or was cancelled) after thousands
    of other commits: it keeps up to 10,000 requests unsettled, and peers' placements count here too."""
    p = make_policy("kvmesh")
    for rid in ("r0", "r1"):
        p.on_replica_added(rid)
    waiting = RequestInfo([1, 2], 2 * BS, BS, 10, None, "waits")
    p.on_routed(waiting, "r0")
    assert p.recent_work()["r0"] > 0
    for i in range(2000):
        p.on_routed(RequestInfo([10_000 + i, 20_000 + i], 2 * BS, BS, 10, None, f"o{i}"), "r1")
    p.on_unrouted(waiting, "r0")
    assert p.recent_work()["r0"] == 0


def test_the_fleet_totals_stay_the_sums_of_the_replicas_work_through_late_withdrawals_and_churn():
    """A withdrawal after the replica's work decayed takes back more than is left there: the replica stops
    at zero, and the totals the balance guard divides must lose only what the replica lost. Else they drift
    below the sums, go negative once the fleet empties, and a new replica starts at a negative mean."""
    p = make_policy("kvmesh", window_tokens_per_replica=50_000)
    for rid in ("r0", "r1"):
        p.on_replica_added(rid)
    for cycle in range(6):
        late = RequestInfo([1, 2], 4096, BS, 16, None, f"late{cycle}")
        p.on_routed(late, "r0")
        for k in range(40):  # traffic on the other replica meanwhile: ages the windows, halves the guard's
            p.on_routed(RequestInfo([10_000 + k, cycle], 4096, BS, 16, None, f"o{cycle}-{k}"), "r1")
        p.on_unrouted(late, "r0")
        assert p._total == pytest.approx(sum(p.recent_work().values()))
        assert p._s_total == pytest.approx(float(p._s[list(p._slot.values())].sum()))
        p.on_replica_removed("r0")
        p.on_replica_added("r0")
    p.on_replica_removed("r0")
    p.on_replica_removed("r1")
    assert p._total >= 0 and p._s_total >= 0
    p.on_replica_added("n0")
    p.on_replica_added("n1")
    assert min(p.recent_work().values()) >= 0


def test_a_fork_after_long_fork_less_traffic_counts_as_its_real_share():
    """Fork counts are stored divided by a scale that decays with every request. Renormalised only when a
    request passed a fork, the scale underflowed through long fork-less traffic and the next fork's share
    of recent requests read as infinite for good: its prompt was copied to every replica."""

    def run(fork_less: int):
        p = make_policy("kvmesh", half_life_requests=1.0)  # one replica: the scale halves per request
        p.on_replica_added("r0")
        for i in range(fork_less):
            p.on_routed(
                RequestInfo([10**7 + 2 * i, 10**7 + 2 * i + 1], 40, 16, 10, None, f"u{i}"), "r0", ReplicaView("r0")
            )
        for i in range(9):  # nine requests branch off block 1: a fork from the eighth
            p.on_routed(RequestInfo([1, 100 + i], 40, 16, 10, None, f"s{i}"), "r0", ReplicaView("r0"))
        return p

    few, many = run(10), run(1060)  # the scale is subnormal by the fork: 1 / it overflows
    share = [p._fork_count[1] * p._fork_k / p._fork_total for p in (few, many)]
    assert 0 < share[1] <= 1
    assert share[1] == pytest.approx(share[0], rel=1e-4)  # the fork-less requests before weigh ~0 by now
    # its share times a fleet of 4 wants about two replicas: a hundred holding it need no further copy
    assert not many._fork_needs_copy(1, holders=100, live=4)
    assert many._fork_needs_copy(1, holders=0, live=4)
