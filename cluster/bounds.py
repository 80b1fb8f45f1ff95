"""What was achievable, computed on the same trace and with the same block rules as the simulator.

- `global_infinite` (`infinite` in `record_bounds`): one cache of unbounded size that sees every
  request (no placement, no eviction): the most any fleet could hit, in any order of arrival
  (`order_free_infinite_hits`: a simulator that waits for replies or caps concurrency sends requests in
  an order of its own).
- `round_robin_infinite` (`record_bounds`): N unbounded caches, request i going to cache i mod N:
  what placement blind to prefixes achieves even with unlimited memory.
- `merged_lru`: one LRU cache with the whole fleet's capacity (replicas x capacity_blocks, plus the
  host tiers when given), seen by every request: what perfect placement could hit with LRU eviction
  at this capacity. Not a strict upper bound (a partitioned cache can occasionally beat LRU, and with
  eviction it replays the trace's order), but the reference a placement policy should reach. With room
  for every block it is the global infinite bound. `merged_lru_with_host` / `merged_lru_with_shared` add
  the host tiers / the host and shared tiers (a policy's hit rate counts their hits too).
- `balance_bounded_bound`: the hit rate a placement reaches with one unbounded cache per replica
  while keeping per-replica prefill (uncached prompt tokens computed) within max/mean 1.10: what
  "as many hits as possible without piling work onto one replica" allows. Found greedily, so a
  reference, not a proof of optimality.
All are token-weighted (cached prompt tokens / prompt tokens) with vLLM's rules (full blocks only,
the last prompt token always computed). `compute_bounds` reports a simulated trace's bounds;
`record_bounds` those of JSONL records replayed at an engine's granularity (`kvmesh trace bounds`,
the live benchmarks), on the same functions after `workloads.engine_trace`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvmesh.cluster.block_cache import BlockLRU, leading_held
from kvmesh.cluster.trace import SOURCE_BLOCK_TOKENS, TraceRequest
from kvmesh.cluster.workloads import engine_trace
from kvmesh.policies.cost_model import cacheable_blocks, cached_tokens


def lru_hit_rate(requests: Sequence[TraceRequest], block_size: int, capacity: int | None) -> float:
    """Token-weighted hit rate of one LRU cache of `capacity` blocks (None = infinite)."""
    cache = BlockLRU(capacity)
    hit = total = 0
    for r in requests:
        ids = r.hash_ids
        hit += cached_tokens(cache.prefix_len(ids), r.input_length, block_size)
        total += r.input_length
        cache.admit(ids[: cacheable_blocks(r.input_length, len(ids), block_size)])
    return hit / total if total else 0.0


def round_robin_infinite_hits(
    requests: Sequence[TraceRequest], block_size: int, replicas: int = 1, warmup: int = 0
) -> tuple[int, int]:
    """(cached, prompt) tokens with request i on unbounded cache i mod `replicas` (plain sets: no recency
    to track); one replica is the infinite cache. The first `warmup` requests fill caches uncounted.
    Only the replicas some request reaches get a set: past the request count a replica stays empty, so
    a fleet far larger than the trace costs no memory."""
    seen: list[set[int]] = [set() for _ in range(min(replicas, len(requests)))]
    hit = total = 0
    for i, r in enumerate(requests):
        ids, held = r.hash_ids, seen[i % replicas]
        got = cached_tokens(leading_held(ids, held), r.input_length, block_size)
        held.update(ids[: cacheable_blocks(r.input_length, len(ids), block_size)])
        if i >= warmup:
            hit += got
            total += r.input_length
    return hit, total


def order_free_infinite_hits(requests: Sequence[TraceRequest], block_size: int, warmup: int = 0) -> tuple[int, int]:
    """(cached, prompt) tokens of one infinite cache, the most over every order the requests could arrive in
    (the first `warmup` requests come first, in any order, and fill the cache uncounted).

    Why not the trace's order: a prompt that ends on a block boundary computes its last block (vLLM hits at
    most (tokens - 1) // block_size blocks) yet stores it, so whether a longer prompt through that block
    hits it depends on which came first; a simulator that waits for replies or caps concurrency sends
    requests in an order of its own. With one infinite cache a request hits a block exactly when an earlier
    request stored it, so per block: every request that could hit it does, but the first to hold it,
    unless that one can be a request that only stores it. An upper bound for any order; equal to the
    trace-order figure when no prompt ending on a boundary follows one that hits its last block."""
    hittable: dict[int, int] = {}  # block -> counted requests that could hit it
    stored: dict[int, int] = {}  # block -> counted requests that store it
    warm: set[int] = set()  # blocks the warm-up requests store
    total = 0
    for i, r in enumerate(requests):
        ids = r.hash_ids
        full = ids[: cacheable_blocks(r.input_length, len(ids), block_size)]
        if i < warmup:
            warm.update(full)
            continue
        total += r.input_length
        for h in set(ids[: max(0, min(len(ids), (r.input_length - 1) // block_size))]):
            hittable[h] = hittable.get(h, 0) + 1
        for h in set(full):
            stored[h] = stored.get(h, 0) + 1
    hit = sum(n - (h not in warm and stored[h] == n) for h, n in hittable.items())
    return hit * block_size, total


def infinite_hit_rate(requests: Sequence[TraceRequest], block_size: int) -> float:
    """Token-weighted hit rate of one infinite cache, in the best order of arrival (`order_free_infinite_hits`)."""
    hit, total = order_free_infinite_hits(requests, block_size)
    return hit / total if total else 0.0


def balance_bounded_bound(
    requests: Sequence[TraceRequest], block_size: int, replicas: int, max_imbalance: float = 1.10, rounds: int = 6
) -> dict:
    """Best hit rate of an untimed placement (an unbounded cache per replica) whose per-replica prefill
    stays within `max_imbalance` x the mean, by greedy bounded affinity (`_bounded_affinity`).

    The greedy caps each replica at `max_imbalance` x max(running mean, a floor). No single floor
    suits every workload, so several passes are made and the best kept:
    - floor 0: the cap follows the running mean. Uniform over time (what a live guard does), but
      the first requests do not fit anywhere and go to the least-loaded replica.
    - floor = the final mean, which depends on the placement: first the least possible one (the
      fleet's prefill under one unbounded cache / replicas; no placement computes less), then the
      mean the previous pass ended with, until it stops changing or `rounds` passes are done. Loose
      early, so one replica can fill up and push later conversations off it.
    The result is the pass with the best hit rate among those that ended within `max_imbalance`,
    else the pass with the lowest imbalance: the reported `imbalance` is what was reached, not
    assumed. A reference, not a proof of optimality. With `max_imbalance` = inf this is pure affinity
    and hits what one infinite cache hits in trace order (an id names its whole prefix, so the replica
    holding the longest prefix of the union holds all of it); that can be below `infinite_hit_rate`, which
    takes the best order of arrival (`order_free_infinite_hits`). Returns hit_rate, imbalance (max/mean prefill),
    max_imbalance, per_replica_prefill, fallbacks (requests no replica had room for), passes."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    tried = [_bounded_affinity(requests, block_size, replicas, max_imbalance, 0.0)]
    least_total = sum(r.input_length for r in requests) * (1.0 - infinite_hit_rate(requests, block_size))
    floor = least_total / replicas
    for _ in range(max(1, rounds)):
        run = _bounded_affinity(requests, block_size, replicas, max_imbalance, floor)
        tried.append(run)
        mean = sum(run["per_replica_prefill"]) / replicas
        if abs(mean - floor) <= 1e-3 * max(floor, 1.0):
            break
        floor = mean
    within = [r for r in tried if r["imbalance"] <= max_imbalance * (1 + 1e-9)]
    best = max(within, key=lambda r: r["hit_rate"]) if within else min(tried, key=lambda r: r["imbalance"])
    return dict(best, max_imbalance=max_imbalance, passes=len(tried))


def online_bounded_greedy(
    requests: Sequence[TraceRequest], block_size: int, replicas: int, caps: Sequence[float] = (1.10, 1.15, 1.20, 1.25)
) -> list[dict]:
    """The same greedy without hindsight, one pass per cap: each replica capped at cap x the running
    mean (floor 0), what an online placement can know. The balance-bounded bound's other passes cap at
    the final mean, which only the finished placement knows; comparing the two says how much of a
    policy's miss only hindsight recovers. A reference like the bound, not an optimum."""
    return [dict(_bounded_affinity(requests, block_size, replicas, cap, 0.0), max_imbalance=cap) for cap in caps]


_ROOT = object()  # the parent recorded for a request's first block


def _bounded_affinity(
    requests: Sequence[TraceRequest], block_size: int, replicas: int, max_imbalance: float, mean_floor: float
) -> dict:
    """One greedy pass. Requests are placed in order; a replica is allowed if its prefill after taking
    the request stays within `max_imbalance` x max(running mean including this request, `mean_floor`).
    When `mean_floor` does not exceed the final mean, both terms are <= the final mean, so a pass
    without fallbacks ends within the bound. Among allowed replicas the longest cached prefix wins,
    ties to the least prefill so far, then the lowest index; when none is allowed, the replica with
    the least prefill after taking the request (a fallback).

    Only a few replicas are scored per request, with the same result as scoring every one: replicas that
    cache the same number of the request's blocks hit the same tokens, so among them the one with the
    least (prefill, index) is allowed whenever any of them is, and wins every comparison the others would.
    The candidates are that replica of each such group (`_group_leaders`). A fleet far larger than the
    trace, or one system prompt on every replica, then no longer costs requests x replicas."""
    holders: dict[int, set[int]] = {}  # block -> replicas holding it: each replica's cache, indexed by block
    parent: dict[int, object] = {}  # block -> the block before it where first seen (`_ROOT`: first of a prompt)
    prefix_ids = True  # every block so far had one parent: an id names its whole prefix (see `_group_leaders`)
    prefill = [0] * replicas
    by_load = [(0, j) for j in range(replicas)]  # (prefill, replica) heap; an entry is stale once prefill moved on
    fleet = hit = total = fallbacks = 0
    for r in requests:
        n, ids = r.input_length, r.hash_ids
        if prefix_ids:
            prev = _ROOT
            for h in ids:
                if parent.setdefault(h, prev) != prev:
                    prefix_ids = False
                    break
                prev = h
        best: tuple[int, int, int] | None = None  # (-cached, prefill, replica) within the limit
        fallback: tuple[int, int, int] | None = None  # (prefill after, -cached, replica) of any
        for j, depth in _group_leaders(ids, holders, prefill, by_load, prefix_ids):
            got = cached_tokens(depth, n, block_size)
            extra = n - got
            mean = max((fleet + extra) / replicas, mean_floor)
            # with nothing computed anywhere every replica is within any limit (inf x 0 would be NaN)
            cap = max_imbalance * mean if mean > 0 else 0.0
            if prefill[j] + extra <= cap * (1 + 1e-9):
                key = (-got, prefill[j], j)
                best = key if best is None or key < best else best
            key = (prefill[j] + extra, -got, j)
            fallback = key if fallback is None or key < fallback else fallback
        if best is None:
            assert fallback is not None  # every request has at least one candidate
            fallbacks += 1
            got, j = -fallback[1], fallback[2]
        else:
            got, j = -best[0], best[2]
        hit += got
        total += n
        if n > got:
            prefill[j] += n - got
            fleet += n - got
            heapq.heappush(by_load, (prefill[j], j))
        for h in ids[: cacheable_blocks(n, len(ids), block_size)]:
            holders.setdefault(h, set()).add(j)
    mean = fleet / replicas
    return {
        "hit_rate": hit / total if total else 0.0,
        "imbalance": max(prefill) / mean if mean else 1.0,
        "per_replica_prefill": prefill,
        "fallbacks": fallbacks,
    }


def _group_leaders(
    ids: Sequence[int], holders: dict[int, set[int]], prefill: list[int], by_load: list, prefix_ids: bool
) -> list[tuple[int, int]]:
    """(replica, leading blocks of `ids` it holds) for, per distinct count, the replica with the least
    (prefill, index) among those holding that many; with `prefix_ids` False, every replica holding
    `ids[0]` instead (with the least-loaded one holding nothing).

    Replicas holding nothing of `ids` are the rest of the fleet: their leader is the first entry of the
    `by_load` heap (lazy: entries whose prefill is not the replica's are dropped) that holds no `ids[0]`.
    With `prefix_ids` (every block has had one parent, so a replica holding `ids[k]` holds `ids[k - 1]`),
    the replicas holding `ids[k - 1]` contain those holding `ids[k]`, and the difference, those holding
    exactly k blocks, is a group with len(holders[ids[k - 1]]) - len(holders[ids[k]]) members. Its leader
    comes from walking the smaller side: the group's enclosing set when it is at most the rest of the
    fleet, else the heap, which passes at most the rest of the fleet before reaching a member."""
    nobody: set[int] = set()
    replicas = len(prefill)

    def least(member) -> int:
        skipped = []
        while True:
            load, j = by_load[0]
            if load != prefill[j]:
                heapq.heappop(by_load)
            elif member(j):
                break
            else:
                skipped.append(heapq.heappop(by_load))
        for entry in skipped:
            heapq.heappush(by_load, entry)
        return j

    first = holders.get(ids[0], nobody) if ids else nobody
    if not prefix_ids:
        out = []
        for j in first:
            depth = 0
            for h in ids:
                if j not in holders.get(h, nobody):
                    break
                depth += 1
            out.append((j, depth))
        if len(first) < replicas:
            out.append((least(lambda j: j not in first), 0))
        return out
    levels = []  # levels[k - 1]: the replicas holding ids[k - 1], so at least k blocks
    for h in ids:
        held = holders.get(h)
        if not held:
            break
        levels.append(held)
    out = []
    for k in range(len(levels) + 1):
        inner = levels[k] if k < len(levels) else nobody
        if k == 0:  # the whole fleet
            if len(inner) == replicas:
                continue
            j = least(lambda j: j not in inner)
        else:
            outer = levels[k - 1]
            count = len(outer) - len(inner)
            if count == 0:
                continue
            if len(outer) <= replicas - count:
                j = min((j for j in outer if j not in inner), key=lambda j: (prefill[j], j))
            else:
                j = least(lambda j: j in outer and j not in inner)
        out.append((j, k))
    return out


def compute_bounds(
    requests: Sequence[TraceRequest],
    block_size: int,
    replicas: int,
    capacity_blocks: int,
    host_blocks_total: int = 0,
    shared: bool = False,
    shared_blocks: int | None = None,
) -> dict[str, float]:
    """`global_infinite`, `merged_lru` (the fleet's HBM), and the merged LRU of every tier a policy's hit rate
    counts: `merged_lru_with_host` (HBM + `host_blocks_total`) when host tiers are given, `merged_lru_with_shared`
    (HBM + host tiers + the shared tier's `shared_blocks`; None = unbounded, which holds every block, so the
    infinite bound) with `shared`."""
    infinite = infinite_hit_rate(requests, block_size)
    stored = (r.hash_ids[: cacheable_blocks(r.input_length, len(r.hash_ids), block_size)] for r in requests)
    blocks = len({h for ids in stored for h in ids})

    def merged(capacity: int) -> float:  # with room for every block nothing is evicted: the infinite bound
        return infinite if capacity >= blocks else lru_hit_rate(requests, block_size, capacity)

    out = {"global_infinite": infinite, "merged_lru": merged(replicas * capacity_blocks)}
    if host_blocks_total:
        out["merged_lru_with_host"] = merged(replicas * capacity_blocks + host_blocks_total)
    if shared:
        every_tier = None if shared_blocks is None else replicas * capacity_blocks + host_blocks_total + shared_blocks
        out["merged_lru_with_shared"] = infinite if every_tier is None else merged(every_tier)
    return out


def record_bounds(
    records: Sequence[dict],
    tokens_per_block: int,
    block_size: int | None = None,
    replicas: int = 1,
    source_block_tokens: int = SOURCE_BLOCK_TOKENS,
    salt_by_tenant: bool = True,
    warmup: int = 0,
) -> dict:
    """Infinite-cache (in any order of arrival) and round-robin-over-`replicas`-infinite-caches (in the
    records' order) bounds of JSONL `records` replayed at `tokens_per_block` tokens per trace block and
    engine blocks of `block_size` (`engine_trace`); `requests` counts the records measured (after `warmup`).

    With `salt_by_tenant`, records of different `tenant`s share nothing (kvmesh salts per tenant).
    The first `warmup` records fill the caches without being counted (the published Mooncake figure,
    39.8% infinite-cache hit rate over the conversation trace's second half, is warmup = half; it
    counts partial blocks, which vLLM never caches, so this bound comes out slightly lower).
    """
    block_size = block_size or tokens_per_block
    if tokens_per_block < 1 or block_size < 1 or tokens_per_block % block_size:
        raise ValueError("tokens_per_block must be a positive multiple of block_size")
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    reqs = engine_trace(
        records, tokens_per_block, block_size, source_block_tokens, salt_by_tenant=salt_by_tenant
    ).requests
    inf_hit, prompt = order_free_infinite_hits(reqs, block_size, warmup)
    rr_hit, _ = round_robin_infinite_hits(reqs, block_size, replicas, warmup)
    return {
        "requests": max(0, len(records) - warmup),
        "warmup": warmup,
        "prompt_tokens": prompt,
        "tokens_per_block": tokens_per_block,
        "block_size": block_size,
        "infinite": {"cached_tokens": inf_hit, "hit_rate": inf_hit / prompt if prompt else 0.0},
        "round_robin_infinite": {
            "replicas": replicas,
            "cached_tokens": rr_hit,
            "hit_rate": rr_hit / prompt if prompt else 0.0,
        },
    }
