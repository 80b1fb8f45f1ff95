"""kvmesh policy with a stale view: placements other routers made that this router has not heard of
yet (`FleetView.unseen_placements`) spread new prefixes instead of piling them onto one replica, and
leave a request whose prefix one replica holds where it is."""

from __future__ import annotations

import numpy as np

from kvmesh.policies.base import FleetView, RequestInfo
from kvmesh.policies.registry import make_policy

BS = 32
N = 16


def fleet(shared=None, unseen: float = 0.0, tokens: float = 0.0) -> FleetView:
    z = np.zeros(N, dtype=np.int64)
    s = z.copy() if shared is None else np.asarray(shared, dtype=np.int64)
    return FleetView(
        [f"r{i}" for i in range(N)],
        s,
        s,
        s,
        z.copy(),
        z.copy(),
        np.zeros(N),
        z.copy(),
        np.full(N, 1000),
        unseen_placements=unseen,
        unseen_tokens=tokens,
    )


def warmed():
    """A policy that has routed 64 cold requests evenly (no cached prefix anywhere), as every router
    sharing placements has."""
    p = make_policy("kvmesh")
    for i in range(N):
        p.on_replica_added(f"r{i}")
    for i in range(64):
        p.on_routed(RequestInfo([5_000_000 + i], 10 * BS, BS, request_id=f"w{i}"), f"r{i % N}")
    return p


def cold(i: int) -> RequestInfo:
    return RequestInfo(list(range(100 * i, 100 * i + 10)), 10 * BS + 5, BS, request_id=f"q{i}")


def test_without_unseen_placements_every_router_picks_the_same_replica():
    p = warmed()
    for i in range(N):  # one replica has less recent work than the others
        if i != 7:
            p.on_routed(RequestInfo([6_000_000 + i], 10 * BS, BS, request_id=f"x{i}"), f"r{i}")
    picks = {p.best(cold(i), fleet()) for i in range(16)}
    assert picks == {7}  # the same stale view, a deterministic ranking: the herd


def test_routers_that_have_sent_nothing_yet_spread_their_first_requests_by_prompt():
    """At start-up every replica ties (no work, nothing cached) and no router has heard of another's
    placements: each router's first request goes where its prompt hashes, not all to the first replica.
    Ranking again picks the same replica, and `place` agrees with `best`."""
    picks = []
    for i in range(16):  # 16 routers, fresh, each with its own first request
        p = make_policy("kvmesh")
        for k in range(N):
            p.on_replica_added(f"r{k}")
        j = p.best(cold(i), fleet())
        assert p.best(cold(i), fleet()) == j and p.place(cold(i), fleet())[0] == j
        picks.append(j)
    assert len(set(picks)) >= 8 and max(picks.count(k) for k in set(picks)) <= 4


def test_unseen_placements_spread_new_prefixes_over_the_replicas_they_may_have_taken():
    p = warmed()
    # 16 requests, each ranked on the same view (16 routers that have not heard of each other yet)
    view = fleet(unseen=15, tokens=10 * BS)
    picks = [p.best(cold(i), view) for i in range(16)]
    assert len(set(picks)) >= 8
    assert max(picks.count(k) for k in set(picks)) <= 4


def test_a_prefix_held_by_one_replica_keeps_its_requests():
    p = warmed()
    shared = np.zeros(N, dtype=np.int64)
    shared[5] = 9  # a conversation's history, on r5 only
    view = fleet(shared, unseen=15, tokens=10 * BS)
    assert {p.best(cold(i), view) for i in range(40)} == {5}


def test_best_is_the_first_of_place_and_ranking_again_picks_the_same():
    p = warmed()
    rng = np.random.default_rng(1)
    for i in range(50):
        view = fleet(rng.integers(0, 3, N), unseen=float(rng.uniform(0, 20)), tokens=float(rng.uniform(0, 400)))
        view.pending_prefill_tokens = rng.integers(0, 2, N) * 300
        req = cold(i)
        first = p.place(req, view)
        assert p.best(req, view) == first[0]
        assert p.place(req, view) == first
        assert sorted(first) == list(range(N))
        p.on_routed(req, view.ids[first[0]], view.view(first[0]))


def test_two_routers_given_one_new_prompt_at_once_send_it_to_one_replica():
    """Two routers that have each routed a different number of requests rank the same new prompt (two
    requests through different fronts, say) on the same stale view: they draw alike and agree."""
    a, b = warmed(), warmed()
    b.on_routed(RequestInfo([6_000_000], 10 * BS, BS, request_id="extra"), "r3")  # histories differ
    view = fleet(unseen=15, tokens=10 * BS)
    agree = 0
    for i in range(16):
        prompt = cold(i)
        twin = RequestInfo(list(prompt.block_hashes), prompt.num_tokens, BS, request_id=f"other-{i}")
        agree += a.best(prompt, view) == b.best(twin, view)
    assert agree >= 14  # their weights differ a little (b routed one more request): rarely the winner


def test_one_new_document_asked_through_two_routers_lands_on_one_replica():
    """Two requests that start the same new content (a document nobody holds yet) and end differently
    (two questions about it), ranked by two routers on the same stale view, agree on its replica: the
    draw is keyed on the first block no replica holds, not on the prompt's end, so the second request
    finds the document where the first put it."""
    a, b = warmed(), warmed()
    b.on_routed(RequestInfo([6_000_000], 10 * BS, BS, request_id="extra"), "r3")
    view = fleet(unseen=15, tokens=10 * BS)
    agree = 0
    for i in range(16):
        doc = list(range(100 * i, 100 * i + 8))
        q1 = RequestInfo([*doc, 7_000_000 + i, 7_100_000 + i], 10 * BS + 5, BS, request_id=f"q1-{i}")
        q2 = RequestInfo([*doc, 8_000_000 + i], 9 * BS + 3, BS, request_id=f"q2-{i}")
        agree += a.best(q1, view) == b.best(q2, view)
    assert agree >= 14  # keyed on each prompt's end they would agree about one time in eight
    # different documents still spread over the replicas the unseen placements may have taken
    picks = [a.best(RequestInfo(list(range(100 * i, 100 * i + 8)), 8 * BS + 1, BS), view) for i in range(16)]
    assert len(set(picks)) >= 8


def test_the_new_content_key_starts_after_the_prefix_some_replica_holds():
    """With a shared system prompt held by every replica, requests differ right after it: their draws
    do not collapse onto one replica (a flood's users keep spreading)."""
    p = warmed()
    shared = np.full(N, 4, dtype=np.int64)  # 4 blocks of system prompt everywhere
    view = fleet(shared, unseen=15, tokens=10 * BS)
    system = [9_000_000 + k for k in range(4)]
    picks = [p.best(RequestInfo([*system, 100 * i, 100 * i + 1], 6 * BS + 1, BS), view) for i in range(16)]
    assert len(set(picks)) >= 8


def test_with_the_hard_guard_ties_are_drawn_the_same_way_by_best_and_place():
    picks = set()
    for i in range(16):
        p = make_policy("kvmesh", guard_weight=None)
        j = p.best(cold(i), fleet())
        assert p.place(cold(i), fleet())[0] == j
        picks.add(j)
    assert len(picks) >= 8  # drawn by prompt, not the first replica every time


def test_unseen_placements_that_cost_nothing_leave_the_deterministic_best():
    """A cost model without a prefill base (a calibrated one has 0) and peers' prompts fully cached (0
    uncached tokens) make an unseen placement charge nothing: there is no work to spread, and water
    filling over a zero charge divided by it (every ranking raised)."""
    p = make_policy("kvmesh", cost={"prefill_base_s": 0.0})
    for i in range(N):
        p.on_replica_added(f"r{i}")
    for i in range(64):
        p.on_routed(RequestInfo([5_000_000 + i], 10 * BS, BS, request_id=f"w{i}"), f"r{i % N}")
    held = [0] * N
    held[3] = 4  # one replica holds part of the prompt: the deterministic best is r3
    for request in (cold(1), cold(2)):
        stale, fresh = fleet(held, unseen=3.0, tokens=0.0), fleet(held)
        assert p.best(request, stale) == p.best(request, fresh) == 3
        assert p.place(request, stale) == p.place(request, fresh)
