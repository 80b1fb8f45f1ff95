"""The best placement of a whole workload under a balance limit, solved exactly (a mixed-integer program).

Why: the robustness target asks, per workload, for a hit rate near the merged-LRU bound *and*
per-replica prefill max/mean <= 1.25. `out_of_reach.balanced_compute_floor` proves some workloads
cannot meet both; the greedy references only say what one heuristic found. Between them a miss is
undecided: the policy's fault or the workload's. Solving the placement problem itself decides it: the
solver's lower bound on computed tokens is a proof that no placement does better, and the placement it
finds, replayed with the simulator's own accounting, shows that one does.

The model (one unbounded cache per replica, no timing: with room for every block, what a replica caches
does not depend on when requests arrive). Requests' full blocks form a prefix tree; chains of blocks
that every request passing the first also passes are one node, weighing their tokens. Per replica m:
y[v, m] = 1 when m computes node v, x[r, m] = 1 when request r runs on m. A request runs on one replica;
its replica computes the node its full blocks end at (y >= x), and a replica computing a node computes
its parent (y[parent] >= y), and computes a node only for a request of its own (y[v] <= its
children's y + the x of requests ending at v: otherwise idle replicas could compute blocks nobody
asked for to raise the mean). Replica m computes load[m] = sum of node weights it computes + the partial
last block of each request it runs. Balance: load[m] <= max_imbalance x the mean load. Minimise the
total. Replicas are interchangeable, so one labelling of each placement is searched (see `symmetry`).
A prompt ending on a block boundary recomputes its last block even where it is cached (vLLM
always computes the last token); the model counts that block once per replica, which never counts
more than a placement computes, so the solver's bound stays a bound.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmesh.cluster.block_cache import leading_held
from kvmesh.cluster.mip_rows import MipRows
from kvmesh.cluster.out_of_reach import balanced_hosts
from kvmesh.cluster.prefix_tree import merged_chains
from kvmesh.cluster.trace import TraceRequest
from kvmesh.policies.cost_model import cacheable_blocks, cached_tokens


def _tree(requests: Sequence[TraceRequest], block_size: int):
    """(node weights in tokens, parent index per node (-1: root), end node per request (-1: no full
    block), partial tail tokens per request, node per block), with unbranching chains merged into one
    node."""
    paths = [r.hash_ids[: r.input_length // block_size] for r in requests]
    weight, up, head = merged_chains(paths, block_size)
    end = [head[p[-1]] if len(p) else -1 for p in paths]
    tails = [r.input_length % block_size for r in requests]
    return weight, up, end, tails, head


def best_balanced_placement(
    requests: Sequence[TraceRequest],
    block_size: int,
    replicas: int,
    max_imbalance: float,
    time_limit_s: float = 10.0,
    max_computed: float | None = None,
    tighten: bool = False,
    symmetry: str = "loads",
) -> dict:
    """Solve for the placement computing the fewest prompt tokens with per-replica computed tokens
    <= `max_imbalance` x their mean. Returns `computed_lower` (no placement computes fewer: a proof),
    `placement` (replica per request, or None when the solver found none in time), `optimal` (the
    solver closed the gap) and `status`.

    With `max_computed`, only placements computing at most that many tokens count (a target's hit rate),
    and the solver stops at the first one it finds: `placement` None with `status` "Infeasible" then
    proves that none exists. Each replica then computes at most max_imbalance x max_computed / replicas,
    so every block is computed on at least as many replicas as `out_of_reach.balanced_hosts` says: those
    counts are added as cuts (the solver's relaxation alone lets one replica compute a fraction of
    everything). With `tighten`, the balance rows take the allowance for prompts ending on a block
    boundary off instead of adding it (the model then never under-counts a placement's imbalance: for
    finding one that replays within the limit, not for proofs).

    Replicas are interchangeable, so one labelling of each placement is enough. `symmetry` "loads" keeps
    loads in decreasing order (load[0] >= load[1] >= ...); "first use" numbers replicas in the order
    requests first reach them (request r runs on one of replicas 0..r). Either is valid alone; which
    solves faster depends on the workload (`decide_target` tries both)."""
    if replicas < 1 or block_size < 1:
        raise ValueError("replicas and block_size must be >= 1")
    weight, up, end, tails, head_of = _tree(requests, block_size)
    V, n, R = len(weight), len(requests), replicas
    # columns: y[v, m] = v * R + m, then x[r, m] = Y + r * R + m, then load[m] = Y + X + m
    Y, X = V * R, n * R
    rows = MipRows()
    add, inf = rows.add, rows.inf
    ms = np.arange(R)
    for r in range(n):  # each request on one replica
        add(Y + r * R + ms, np.ones(R), 1.0, 1.0)
    runs_at: list[list[int]] = [[] for _ in range(V)]  # requests whose full blocks end at each node
    for r, v in enumerate(end):  # its replica computes the node its full blocks end at
        if v >= 0:
            runs_at[v].append(r)
            for m in range(R):
                add([v * R + m, Y + r * R + m], [1.0, -1.0], 0.0, inf)
    below: list[list[int]] = [[] for _ in range(V)]  # each node's children
    for v, p in enumerate(up):  # a replica computing a node computes its parent
        if p >= 0:
            below[p].append(v)
            for m in range(R):
                add([p * R + m, v * R + m], [1.0, -1.0], 0.0, inf)
    for v in range(V):  # and only then: no replica computes a node no request of its needs (no padding)
        for m in range(R):
            cover = [v * R + m] + [c * R + m for c in below[v]] + [Y + r * R + m for r in runs_at[v]]
            add(cover, [1.0] + [-1.0] * (len(cover) - 1), -inf, 0.0)
    w = np.asarray(weight, dtype=np.float64)
    t = np.asarray(tails, dtype=np.float64)
    for m in range(R):  # load[m] = what replica m computes
        idx = np.concatenate([np.arange(V) * R + m, Y + np.arange(n) * R + m, [Y + X + m]])
        add(idx, np.concatenate([w, t, [-1.0]]), 0.0, 0.0)
    # a placement exactly at the balance limit or the computed-token budget meets it: the limits get the same
    # relative slack as `replay_placement`'s check in `decide_target` and `out_of_reach.target_out_of_reach`, so
    # float noise in a limit derived from a placement's own figures (max/mean 14 / (34 / 3) times 34 / 3 is
    # 13.999999999999998) cannot cut that placement off
    limit = max_imbalance * (1 + 1e-9)
    share = limit / R
    # a prompt ending on a block boundary may count one block less here than it computes (see above):
    # the balance rows allow for that much, so every real placement within the limit stays in the model
    slack = share * block_size * sum(1 for r in requests if r.input_length % block_size == 0)
    slack = -slack if tighten else slack
    for m in range(R):  # balance: load[m] <= max_imbalance x mean
        val = np.full(R, -share)
        val[m] += 1.0
        add(Y + X + ms, val, -inf, slack)
    if max_computed is not None:
        budget = max_computed * (1 + 1e-9)
        add(Y + X + ms, np.ones(R), -inf, float(budget))
        found = balanced_hosts(requests, block_size, R, limit * budget / R)
        if found is None:
            return {
                "computed_lower": float("inf"),
                "placement": None,
                "optimal": True,
                "status": "Infeasible",
                "nodes": V,
            }
        node_hosts = [1] * V
        for h, k in found[1].items():  # a merged node's blocks are all computed wherever its first one is
            v = head_of.get(h)
            if v is not None:
                node_hosts[v] = max(node_hosts[v], k)
        for v, k in enumerate(node_hosts):
            if k > 1:
                add(np.arange(R) + v * R, np.ones(R), float(k), inf)
    if symmetry == "loads":
        for m in range(R - 1):
            add([Y + X + m, Y + X + m + 1], [1.0, -1.0], 0.0, inf)
    elif symmetry != "first use":
        raise ValueError(f"symmetry must be 'loads' or 'first use', got {symmetry!r}")

    x_upper = np.ones((n, R))
    if symmetry == "first use":
        x_upper[np.arange(R)[None, :] > np.arange(n)[:, None]] = 0.0
    solver = rows.solve(
        np.concatenate([np.zeros(Y + X), np.ones(R)]),
        np.zeros(Y + X + R),
        np.concatenate([np.ones(Y), x_upper.ravel(), np.full(R, inf)]),
        Y + X,
        time_limit_s,
        first_solution=max_computed is not None,  # any placement within the limit answers the question
    )
    info = solver.getInfo()
    status = solver.modelStatusToString(solver.getModelStatus())
    placement = None
    if info.primal_solution_status == 2:  # a feasible integer solution
        xv = np.asarray(solver.getSolution().col_value[Y : Y + X]).reshape(n, R)
        placement = [int(k) for k in xv.argmax(axis=1)]
    optimal = status == "Optimal"
    if status == "Infeasible":
        lower_bound = float("inf")
    else:
        lower_bound = info.objective_function_value if optimal else info.mip_dual_bound
    return {
        "computed_lower": float(lower_bound) if not np.isnan(lower_bound) else 0.0,
        "placement": placement,
        "optimal": optimal,
        "status": status,
        "nodes": V,
    }


def replay_placement(
    requests: Sequence[TraceRequest], block_size: int, replicas: int, placement: Sequence[int]
) -> dict:
    """The hit rate and per-replica computed tokens of `placement` (replica per request), in trace order,
    with one unbounded cache per replica and vLLM's rule that the last prompt token is always computed
    (the simulator's accounting)."""
    held: list[set[int]] = [set() for _ in range(replicas)]
    computed = [0] * replicas
    prompt = cached = 0
    for r, m in zip(requests, placement):
        n = r.input_length
        hit = cached_tokens(leading_held(r.hash_ids, held[m]), n, block_size)
        cached += hit
        prompt += n
        computed[m] += n - hit
        held[m].update(r.hash_ids[: cacheable_blocks(n, len(r.hash_ids), block_size)])
    mean = sum(computed) / replicas
    return {
        "hit_rate": cached / prompt if prompt else 0.0,
        "computed": computed,
        "imbalance": max(computed) / mean if mean else 1.0,
    }


def decide_target(
    requests: Sequence[TraceRequest],
    block_size: int,
    replicas: int,
    hit_rate: float,
    max_imbalance: float,
    time_limit_s: float = 10.0,
) -> dict:
    """Can a placement reach token hit rate `hit_rate` with per-replica prefill max/mean <= `max_imbalance`?
    `verdict` "reachable" (`placement` is one, checked by `replay_placement`), "out of reach" (the solver
    proved that none is) or "undecided" (neither within `time_limit_s` per attempt: each symmetry
    breaking in turn, and again with `tighten` when a placement found does not replay within the limit)."""
    prompt = sum(r.input_length for r in requests)
    allowed = prompt * (1.0 - hit_rate)

    def meets(placement) -> dict | None:
        got = replay_placement(requests, block_size, replicas, placement)
        ok = got["hit_rate"] >= hit_rate * (1 - 1e-12) and got["imbalance"] <= max_imbalance * (1 + 1e-9)
        return got if ok else None

    status = ""
    for symmetry in ("first use", "loads"):  # the first finds placements fast, the second proves more
        res = best_balanced_placement(
            requests, block_size, replicas, max_imbalance, time_limit_s, allowed, symmetry=symmetry
        )
        status = res["status"]
        if status == "Infeasible" or res["computed_lower"] > allowed * (1 + 1e-9):
            return {"verdict": "out of reach", "placement": None, "replayed": None, "status": status}
        if res["placement"] is not None and meets(res["placement"]) is None:
            res = best_balanced_placement(
                requests, block_size, replicas, max_imbalance, time_limit_s, allowed, True, symmetry
            )
        if res["placement"] is not None:
            got = meets(res["placement"])
            if got is not None:
                return {"verdict": "reachable", "placement": res["placement"], "replayed": got, "status": status}
    return {"verdict": "undecided", "placement": None, "replayed": None, "status": status}
