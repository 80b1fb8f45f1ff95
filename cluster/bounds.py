"""What was achievable, computed on the same trace and with the same block rules as the simulator.

- `global_infinite`: one cache of unbounded size that sees every request (no placement, no
  eviction): the most any fleet could hit.
- `merged_lru`: one LRU cache with the whole fleet's capacity (replicas x capacity_blocks, plus the
  host tiers when given), seen by every request: what perfect placement could hit with LRU eviction
  at this capacity. Not a strict upper bound (a partitioned cache can occasionally beat LRU), but
  the reference a placement policy should reach.
Both are token-weighted (cached prompt tokens / prompt tokens) with vLLM's rules (full blocks only,
the last prompt token always computed).
"""
from __future__ import annotations

from typing import Sequence

from cluster.block_cache import BlockLRU, leading_held
from cluster.trace import TraceRequest
from policies.cost_model import cacheable_blocks, cached_tokens


def lru_hit_rate(requests: Sequence[TraceRequest], block_size: int, capacity: int | None) -> float:
    """Token-weighted hit rate of one LRU cache of `capacity` blocks (None = infinite)."""
    cache = BlockLRU(capacity)
    hit = total = 0
    for r in requests:
        ids = r.hash_ids
        hit += cached_tokens(cache.prefix_len(ids), r.input_length, block_size)
        total += r.input_length
        cache.admit(ids[:cacheable_blocks(r.input_length, len(ids), block_size)])
    return hit / total if total else 0.0


def infinite_hit_rate(requests: Sequence[TraceRequest], block_size: int) -> float:
    """Token-weighted hit rate of one infinite cache (a plain set: no recency to track)."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        ids = r.hash_ids
        hit += cached_tokens(leading_held(ids, seen), r.input_length, block_size)
        total += r.input_length
        seen.update(ids[:cacheable_blocks(r.input_length, len(ids), block_size)])
    return hit / total if total else 0.0


def compute_bounds(requests: Sequence[TraceRequest], block_size: int, replicas: int, capacity_blocks: int,
                   host_blocks_total: int = 0) -> dict[str, float]:
    out = {
        "global_infinite": infinite_hit_rate(requests, block_size),
        "merged_lru": lru_hit_rate(requests, block_size, replicas * capacity_blocks),
    }
    if host_blocks_total:
        out["merged_lru_with_host"] = lru_hit_rate(requests, block_size, replicas * capacity_blocks + host_blocks_total)
    return out
