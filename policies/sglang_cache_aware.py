"""SGLang router's `cache_aware` policy, re-implemented from its published description for comparison.

Source: sgl-project/sglang `sgl-router` README / docs/router/router.md ("Cache-Aware Load-Balancing
Router") and the defaults of the `sglang-router==0.3.2` wheel (`sglang_router/router_args.py`:
cache_threshold=0.3, balance_abs_threshold=64, balance_rel_threshold=1.5, max_tree_size=2**26).
Taken: the two-mode decision. The system is imbalanced when BOTH (max_load - min_load) >
balance_abs_threshold AND max_load > balance_rel_threshold * min_load, where load is the router's
count of outstanding requests per worker; then the least-loaded worker wins. Otherwise the worker
with the longest prefix match in the router's approximate tree (fed with each routed request, LRU
trimmed) wins if match/len > cache_threshold, else the worker with the smallest tree. Differences:
the tree is over block hashes, not characters, and `max_tree_tokens` bounds it in tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.policies.approx_tree import ApproxTree
from kvmesh.policies.base import Policy, ReplicaView, RequestInfo
from kvmesh.policies.baselines import outstanding


class SglangCacheAware(Policy):
    name = "sglang_cache_aware"

    def __init__(
        self,
        seed: int = 0,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_tokens: int = 2**26,
        **params,
    ):
        super().__init__(
            seed,
            cache_threshold=cache_threshold,
            balance_abs_threshold=balance_abs_threshold,
            balance_rel_threshold=balance_rel_threshold,
            max_tree_tokens=max_tree_tokens,
            **params,
        )
        self.cache_threshold = cache_threshold
        self.abs_t = balance_abs_threshold
        self.rel_t = balance_rel_threshold
        self.tree = ApproxTree(max_tree_tokens)

    def rank(self, request: RequestInfo, replicas: Sequence[ReplicaView]) -> list[str]:
        if not replicas:
            return []
        loads = {v.replica_id: outstanding(v) for v in replicas}
        by_load = sorted(loads, key=lambda r: loads[r])
        lo, hi = loads[by_load[0]], loads[by_load[-1]]
        if hi - lo > self.abs_t and hi > self.rel_t * lo:
            return by_load
        ids = list(loads)
        match = self.tree.match(request.block_hashes, ids)
        best = max(ids, key=lambda r: match[r])  # first of equals in replica order
        total = max(len(request.block_hashes), 1)
        if match[best] / total > self.cache_threshold:
            first = best
        else:
            first = min(ids, key=lambda r: self.tree.size(r))
        return [first] + [r for r in by_load if r != first]

    def on_routed(self, request, replica_id, view=None):
        super().on_routed(request, replica_id, view)
        self.tree.insert(replica_id, request.block_hashes, request.block_size)

    def on_replica_removed(self, replica_id):
        self.tree.remove_replica(replica_id)
