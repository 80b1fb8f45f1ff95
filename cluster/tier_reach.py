"""A proof that the hit-rate and balance targets cannot both be met on a workload even with a shared tier.

Why: with LMCache's shared tier behind every replica (as deployed), a replica that lacks a prefix another
one computed loads it, so hit rate no longer pulls against balance the way it does with one cache per
replica (`out_of_reach`, `exact_placement`). What is left is granularity: a block is computed by one
request, on that request's replica, and some workloads have a request (or a prompt and the few requests
that can carry it) too large for any replica to take within the balance limit. A miss on such a workload
is the workload's, not the policy's.

The model is a relaxation of what the simulator's shared tier allows (any order of arrival, any holding),
so an infeasible model is a proof, and a feasible one proves nothing. Requests' cacheable blocks (all
but the block holding the last prompt token) form a prefix tree; unbranching chains no request ends
inside are one node (the first request to compute a chain's first block computes the whole chain: a
request stores all its blocks at once, so no later block of the chain can be loadable before the first).
Binary x[r, m]: request r runs on replica m; y[v, m]: m computes node v. Every node is computed somewhere
(y summed over m >= 1), on a replica running a request through it (y[v, m] <= the x[r, m] of those
requests), except nodes holding the last block of a prompt that ends on a block boundary (that request
computes it as part of its tail, and so may store it for the others). Replica m computes at least
load[m] = the tokens of the nodes it computes + its requests' tails (what follows the cacheable blocks).
Computing at most `allowed` tokens in all (the hit rate) with max/mean <= `max_imbalance` means no
replica computes more than max_imbalance x allowed / replicas; the model asks whether loads within that,
summing to at most `allowed`, exist.

Order adds one more rule where it is known: no request arriving before the first one through a node
passes through it, so nothing computes or stores that node before the first one does, and it computes
the node itself (y[v, m] >= x[first, m]). The simulator handles requests in trace order under timed
arrivals; its closed-loop client sends every user's first request (and every request without a user)
in trace order before any later turn, and each user's turns in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmesh.cluster.mip_rows import MipRows
from kvmesh.cluster.prefix_tree import merged_chains
from kvmesh.cluster.trace import TraceRequest


def _tier_tree(requests: Sequence[TraceRequest], block_size: int):
    """(node weights in tokens, requests through each node, nodes a boundary prompt's tail may compute,
    tail tokens per request), chains merged into one node."""
    paths = [list(r.hash_ids[: max(0, (r.input_length - 1) // block_size)]) for r in requests]
    boundary_last = {
        r.hash_ids[r.input_length // block_size - 1]
        for r in requests
        if r.input_length % block_size == 0 and len(r.hash_ids) >= r.input_length // block_size > 0
    }
    weight, _, head = merged_chains(paths, block_size)
    covered = [False] * len(weight)
    for h in boundary_last:
        if h in head:
            covered[head[h]] = True
    through: list[set[int]] = [set() for _ in weight]
    for k, path in enumerate(paths):
        for h in path:
            through[head[h]].add(k)
    tails = [r.input_length - len(p) * block_size for r, p in zip(requests, paths)]
    return weight, through, covered, tails


def _opening_requests(users: Sequence) -> set[int]:
    """Requests the closed-loop client sends before any later turn: each user's first, and every request
    without a user."""
    seen: set = set()
    out = set()
    for k, user in enumerate(users):
        if user is None or user not in seen:
            out.add(k)
        if user is not None:
            seen.add(user)
    return out


def _first_through(rs: list[int], users: Sequence | None, opens: set[int], timed: bool = False) -> int | None:
    """The request, of `rs` (sorted), that arrives first whatever the timing; None when that depends on it.
    `timed`: requests are sent at their trace times, a user's next turn no earlier than its previous reply
    (`ClosedLoop.timed`), so only an opening request is sure to be sent at its time."""
    if users is None:
        return rs[0]
    if timed:
        return rs[0] if rs[0] in opens or len({users[r] for r in rs}) == 1 else None
    opening = [r for r in rs if r in opens]
    if opening:
        return opening[0]
    return rs[0] if len({users[r] for r in rs}) == 1 else None


def tier_target_out_of_reach(
    requests: Sequence[TraceRequest],
    block_size: int,
    replicas: int,
    hit_rate: float,
    max_imbalance: float,
    time_limit_s: float = 10.0,
    users: Sequence | None = None,
    timed: bool = False,
) -> dict:
    """Can any placement with a shared tier reach token hit rate `hit_rate` with per-replica prefill
    max/mean <= `max_imbalance`? `verdict`: "out of reach" (proved: no placement can), "not excluded"
    (the relaxation has a solution: nothing is proved) or "undecided" (the solver ran out of time).
    Also `max_load` (the most one replica may compute) and `largest_request` (the most one request must
    compute on its own replica: its tail and the nodes only it passes through). `users` (one per request,
    None for a request without one) says the requests are sent by the closed-loop client, all at once under
    its concurrency, or with `timed` at their trace times, a user's next turn after its previous reply;
    without it they arrive in trace order."""
    if replicas < 1 or block_size < 1:
        raise ValueError("replicas and block_size must be >= 1")
    prompt = sum(r.input_length for r in requests)
    allowed = prompt * (1.0 - hit_rate)
    max_load = max_imbalance * allowed / replicas
    weight, through, covered, tails = _tier_tree(requests, block_size)
    own = list(tails)
    for v, rs in enumerate(through):
        if len(rs) == 1 and not covered[v]:
            own[next(iter(rs))] += weight[v]
    largest = max(own, default=0)
    out = {"max_load": max_load, "computed_allowed": allowed, "largest_request": largest}
    if largest > max_load * (1 + 1e-9):
        return {**out, "verdict": "out of reach", "by": "one request"}
    V, n, R = len(weight), len(requests), replicas
    Y, X = V * R, n * R  # columns: y[v, m] = v * R + m, x[r, m] = Y + r * R + m, load[m] = Y + X + m
    rows = MipRows()
    add, inf = rows.add, rows.inf
    ms = np.arange(R)
    for r in range(n):
        add(Y + r * R + ms, np.ones(R), 1.0, 1.0)
    opens = _opening_requests(users) if users is not None else set()
    for v in range(V):
        if not covered[v]:
            add(v * R + ms, np.ones(R), 1.0, inf)
        rs = sorted(through[v])
        for m in range(R):
            add([v * R + m] + [Y + r * R + m for r in rs], [1.0] + [-1.0] * len(rs), -inf, 0.0)
        first = None if covered[v] else _first_through(rs, users, opens, timed)
        if first is not None:
            for m in range(R):
                add([v * R + m, Y + first * R + m], [1.0, -1.0], 0.0, inf)
    w = np.asarray(weight, dtype=np.float64)
    t = np.asarray(tails, dtype=np.float64)
    for m in range(R):
        idx = np.concatenate([np.arange(V) * R + m, Y + np.arange(n) * R + m, [Y + X + m]])
        add(idx, np.concatenate([w, t, [-1.0]]), 0.0, 0.0)
    add(Y + X + ms, np.ones(R), -inf, allowed)
    for m in range(R - 1):  # replicas are interchangeable: loads in decreasing order
        add([Y + X + m, Y + X + m + 1], [1.0, -1.0], 0.0, inf)
    cost = np.concatenate([np.zeros(Y + X), np.ones(R)])
    upper = np.concatenate([np.ones(Y + X), np.full(R, max_load)])
    solver = rows.solve(cost, np.zeros(Y + X + R), upper, Y + X, time_limit_s, first_solution=True)
    status = solver.modelStatusToString(solver.getModelStatus())
    if status == "Infeasible":
        verdict = "out of reach"
    elif solver.getInfo().primal_solution_status == 2:
        verdict = "not excluded"
    else:
        verdict = "undecided"
    return {**out, "verdict": verdict, "by": "solver", "status": status}
