"""A proof that a hit-rate target and a balance target cannot both be met on a workload, by any placement.

Why: the robustness target asks for a hit rate near the merged-LRU bound *and* per-replica prefill
max/mean <= 1.25. On some workloads no placement can do both (24 requests of one system prompt on 8
replicas: balancing means every replica computes the prompt). The greedy references
(`bounds.balance_bounded_bound`) only say what one heuristic found; this says what no placement can beat,
so a miss on such a workload is the workload's, not the policy's.

The arithmetic (one unbounded cache per replica, vLLM's block rules, any order of arrival). Put the
requests' cacheable blocks in a prefix tree. A replica that runs any request passing through block h
computes h once, and also every block above h. So with every replica computing at most L tokens, the
work below h, W(h) (each block g below h on its hosts(g) replicas, plus each request's tail), is
spread over at least hosts(h) = ceil(W(h) / (L - h and the tokens above it)) replicas, each of which
computes h (and over no fewer than any block below h needs). Summing hosts times the block size over
the tree, plus the tails, gives a floor on the tokens any such placement computes. A hit rate of
`hit` allows at most prompt * (1 - hit) computed, and a balance of `max_imbalance` allows
L = max_imbalance * computed / replicas; when the floor exceeds what the hit rate allows (or a request
cannot fit under L at all) the two targets exclude each other. The floor is a lower bound, not the
optimum (on small random workloads, checked against every placement, it is often exact): where it does
not prove a target out of reach, the target may still be.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvmesh.cluster.trace import TraceRequest


def balanced_compute_floor(
    requests: Sequence[TraceRequest], block_size: int, replicas: int, max_load: float
) -> int | None:
    """Fewest prompt tokens any placement of `requests` on `replicas` unbounded caches computes while no
    replica computes more than `max_load`; None when no placement keeps every replica under it
    (`balanced_hosts`'s floor)."""
    found = balanced_hosts(requests, block_size, replicas, max_load)
    return None if found is None else found[0]


def balanced_hosts(
    requests: Sequence[TraceRequest], block_size: int, replicas: int, max_load: float
) -> tuple[int, dict[int, int]] | None:
    """(the floor: fewest prompt tokens any placement computes while no replica computes more than
    `max_load`, the fewest replicas that compute each block under that limit); None when no placement
    keeps every replica under it.

    Bottom-up over the prefix tree: block h is computed on at least hosts(h) replicas, where the work
    below h (each block g below it on its own hosts(g) replicas, plus the tails of the requests through
    h) shared by hosts each with `max_load` minus h and the blocks above it of room, and no fewer than
    any block below it needs. Ids name their whole prefix (as `block_cache.leading_held` assumes), so the
    tree is keyed by id. A request's tail is what it always computes past its cacheable prefix (vLLM
    recomputes the last token; when the prompt ends on a block boundary that block may be cached by
    another request, so the tail counts nothing there rather than risk counting the block twice)."""
    if replicas < 1 or block_size < 1:
        raise ValueError("replicas and block_size must be >= 1")
    depth: dict[int, int] = {}
    parent: dict[int, int | None] = {}
    through: dict[int, int] = {}  # requests whose cacheable prefix passes through each block
    rest: dict[int, int] = {}  # work below each block; starts as the tails of the requests ending there
    loose = 0  # tails of requests without a cacheable block
    for r in requests:
        n = r.input_length
        most = max(0, (n - 1) // block_size)
        tail = n - most * block_size if n % block_size else 0
        path = r.hash_ids[:most]
        if tail + len(path) * block_size > max_load:
            return None
        above = None
        for k, h in enumerate(path):
            if h not in depth:
                depth[h], parent[h], through[h], rest[h] = k, above, 0, 0
            through[h] += 1
            above = h
        if above is None:
            loose += tail
        else:
            rest[above] += tail
    hosts: dict[int, int] = dict.fromkeys(depth, 1)
    floor: int = loose
    for h in sorted(depth, key=depth.__getitem__, reverse=True):  # every block after all blocks below it
        room = max_load - (depth[h] + 1) * block_size
        if room <= 0 and rest[h] > 0:
            return None  # a request below h cannot fit under the limit on any replica
        need = math.ceil(rest[h] / room - 1e-9) if room > 0 else 1  # float noise must not round up
        hosts[h] = max(hosts[h], need)
        if hosts[h] > min(through[h], replicas):
            return None
        work = hosts[h] * block_size + rest[h]
        up = parent[h]
        if up is None:
            floor += work
        else:
            rest[up] += work
            hosts[up] = max(hosts[up], hosts[h])
    return floor, hosts


def target_out_of_reach(
    requests: Sequence[TraceRequest], block_size: int, replicas: int, hit_rate: float, max_imbalance: float
) -> dict:
    """Can any placement reach token hit rate `hit_rate` with per-replica prefill max/mean <=
    `max_imbalance`? `out_of_reach` True is a proof that none can; False proves nothing.
    Also returns the tokens the hit rate allows to be computed, the largest per-replica load that
    balance then allows, and the floor on computed tokens under that load (None: nothing fits)."""
    prompt = sum(r.input_length for r in requests)
    allowed = prompt * (1.0 - hit_rate)
    max_load = max_imbalance * allowed / replicas * (1 + 1e-9)  # a placement exactly at the limit meets it
    floor = balanced_compute_floor(requests, block_size, replicas, max_load) if allowed > 0 else None
    return {
        # with no prompt token every placement computes nothing and hits 0.0 at max/mean 1.0 (as `replay_placement`
        # reports it): no floor proves anything, and a target of hit rate 0 is met
        "out_of_reach": prompt > 0 and (floor is None or floor > allowed * (1 + 1e-9)),
        "computed_allowed": allowed,
        "max_load": max_load,
        "computed_floor": floor,
    }
