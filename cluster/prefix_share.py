"""The offline pass of `kvmesh cachetest`: how much of a request log repeats, at token level, before any
request is sent -- with the served model's tokenizer and chat template, so the figures are about the
token ids the engine will see, not about the text.

- `repeated_prefix_share`: Σ over requests of the longest token prefix shared with any EARLIER request of
  the same tenant, / Σ prompt tokens. What a cache with unlimited memory and token (not block)
  granularity could reuse; `..._any_tenant` ignores tenant isolation (the reuse salts forbid).
- `bounds`: vLLM's block rules (full blocks only, the last prompt token always computed) on the real
  block hashes (`kvstore/hashing.py`, one salt per tenant) through `cluster/bounds.py`: one infinite cache,
  and N infinite caches fed round robin (what placement blind to prefixes reaches), per replica count.

The longest shared prefix with any earlier prompt is found from the two lexicographic neighbours of the
prompt among the earlier ones (the longest common prefix with a set is reached at a neighbour), so the
pass is O(n log n) comparisons, fast enough for logs of tens of thousands of requests.
"""

from __future__ import annotations

import bisect
import gc
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.cluster.bounds import order_free_infinite_hits, round_robin_infinite_hits
from kvmesh.cluster.trace import TraceRequest
from kvmesh.kvstore.hashing import HashMemo, block_hashes


@dataclass
class TokenizedRequest:
    """A logged request as token ids, with its block hashes under its tenant's salt and with none."""

    index: int
    id: str
    tenant: str | None
    model: str | None
    ids: list[int]
    salted: list[int] = field(default_factory=list)  # block hashes with the tenant's (stand-in) salt
    unsalted: list[int] = field(default_factory=list)  # block hashes with no salt (shared across tenants)

    @property
    def n(self) -> int:
        return len(self.ids)


def tenant_salt(tenant: str | None) -> str:
    """A stand-in salt per tenant: distinct tenants share nothing, as under kvmesh's server-side salts."""
    return f"cachetest-tenant:{tenant or ''}"


def hash_requests(reqs: Sequence[TokenizedRequest], block_size: int, algo: str = "sha256") -> None:
    """Fill `salted` and `unsalted` (memoised: shared prefixes are hashed once)."""
    memo = HashMemo()
    for r in reqs:
        r.salted = block_hashes(r.ids, block_size, algo=algo, cache_salt=tenant_salt(r.tenant), memo=memo)
        r.unsalted = block_hashes(r.ids, block_size, algo=algo, memo=memo)


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _EarlierPrompts:
    """Sorted earlier prompts: the longest prefix a new prompt shares with any of them."""

    def __init__(self) -> None:
        self.sorted: list[tuple] = []

    def longest_shared(self, ids: tuple) -> int:
        k = bisect.bisect_left(self.sorted, ids)
        best = 0
        for j in (k - 1, k):
            if 0 <= j < len(self.sorted):
                best = max(best, _lcp(ids, self.sorted[j]))
        return best

    def add(self, ids: tuple) -> None:
        bisect.insort(self.sorted, ids)


def shared_prefixes(reqs: Sequence[TokenizedRequest], by_tenant: bool = True) -> list[int]:
    """Per request, the longest token prefix shared with an earlier request (of its tenant if `by_tenant`)."""
    earlier: dict[str | None, _EarlierPrompts] = {}
    out = []
    for r in reqs:
        scope = earlier.setdefault(r.tenant if by_tenant else None, _EarlierPrompts())
        ids = tuple(r.ids)
        out.append(scope.longest_shared(ids))
        scope.add(ids)
    return out


def as_trace(reqs: Sequence[TokenizedRequest]) -> list[TraceRequest]:
    return [TraceRequest(float(r.index), r.n, 0, r.salted, r.tenant) for r in reqs]


def offline_pass(reqs: Sequence[TokenizedRequest], block_size: int, replicas: Sequence[int] = (1, 2, 4)) -> dict:
    """The offline figures of a hashed log (`hash_requests` first)."""
    gc_was = gc.isenabled()
    gc.disable()  # many small tuples, no cycles (see cachetest_analysis.paused_gc)
    try:
        return _offline_pass(reqs, block_size, replicas)
    finally:
        if gc_was:
            gc.enable()


def _offline_pass(reqs: Sequence[TokenizedRequest], block_size: int, replicas: Sequence[int]) -> dict:
    prompt = sum(r.n for r in reqs)
    shared = shared_prefixes(reqs)
    shared_any = shared_prefixes(reqs, by_tenant=False)
    trace = as_trace(reqs)
    # the bound over every arrival order (cluster/bounds.py, as `kvmesh demo`'s text bound): a live run sends in
    # an order of its own, and in record order a prompt ending on a block boundary can make the bound too low
    inf_hit, _ = order_free_infinite_hits(trace, block_size)
    per_replica = {}
    for n in sorted(set(replicas)):
        hit, _ = round_robin_infinite_hits(trace, block_size, n)
        per_replica[str(n)] = {"cached_tokens": hit, "hit_rate": hit / prompt if prompt else 0.0}
    tenants: dict[str, dict] = {}
    for r, s in zip(reqs, shared):
        row = tenants.setdefault(r.tenant or "", {"requests": 0, "prompt_tokens": 0, "repeated_tokens": 0})
        row["requests"] += 1
        row["prompt_tokens"] += r.n
        row["repeated_tokens"] += s
    return {
        "requests": len(reqs),
        "prompt_tokens": prompt,
        "block_size": block_size,
        "repeated_prefix_tokens": sum(shared),
        "repeated_prefix_share": sum(shared) / prompt if prompt else 0.0,
        "repeated_prefix_share_any_tenant": sum(shared_any) / prompt if prompt else 0.0,
        "infinite_cache": {"cached_tokens": inf_hit, "hit_rate": inf_hit / prompt if prompt else 0.0},
        "round_robin_infinite": per_replica,
        "per_tenant": tenants,
    }
