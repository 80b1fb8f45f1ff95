"""SGLang router's `cache_aware` policy, re-implemented for comparison at the version the live bench runs.

Sources: sgl-project/sglang `sgl-model-gateway/src/policies/cache_aware.rs` (`select_worker`,
`select_worker_min_load`) as changed by PR #14650 (merged 2025-12-08, "cache-aware router should pick min
load instead of min tenant size", shipped in sglang-router 0.3.x), and the defaults of the
`sglang-router==0.3.2` wheel (`sglang_router/router_args.py`: cache_threshold=0.3, balance_abs_threshold=64,
balance_rel_threshold=1.5, max_tree_size=2**26). The 0.3.2 binary was checked with two stub workers: distinct
cold prompts all went to one idle worker while its tree grew, and to the other while the first had a request
in flight (min load, not the smallest tree).
Taken: the two-mode decision. The system is imbalanced when BOTH (max_load - min_load) >
balance_abs_threshold AND max_load > balance_rel_threshold * min_load, where load is the router's
count of outstanding requests per worker; then the least-loaded worker wins. Otherwise the worker
with the longest prefix match in the router's approximate tree (fed with each routed request, LRU
trimmed) wins if match/len > cache_threshold, else the least-loaded worker (ties: the first in worker
order, as `min_by_key` keeps); match/len is the matched share of the whole prompt (`tree.rs`
`prefix_match_with_counts`: matched characters / input characters), here matched blocks x block size /
prompt tokens, the partial last block counted in the length. The tree holds a prompt only for the worker
the request went to: the live router's withdrawn first choices are taken back out (`on_unrouted`).
Differences: the tree is over block hashes, not characters, so matching stops at block boundaries (a
shared prefix ending mid-block counts only its full blocks, and a prompt shorter than one block never
matches: a policy sees only full blocks' hashes), and `max_tree_size` (characters, as SGLang counts them)
bounds it at `chars_per_token` (4, as for Ray's bounds in `ray_prefix_affinity`) characters a token.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.policies.base import Policy, ReplicaView, RequestInfo
from kvmesh.policies.baselines import outstanding
from kvmesh.policies.cost_model import check_param
from kvmesh.policies.routed_tree import RoutedTree


def match_rate(matched_blocks: int, request: RequestInfo) -> float:
    """The matched share of the whole prompt, partial last block included: SGLang's `matched_char_count /
    input_char_count` and Ray's `len(matched_text) / len(input_text)` in tokens. Matching stops at block
    boundaries, so a prompt shorter than one block never matches (its rate is 0)."""
    size = request.block_size
    total = max(request.num_tokens, len(request.block_hashes) * size, 1)
    return matched_blocks * size / total


class SglangCacheAware(Policy):
    name = "sglang_cache_aware"

    def __init__(
        self,
        seed: int = 0,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int | None = 2**26,
        chars_per_token: int = 4,
        **params,
    ):
        super().__init__(
            seed,
            cache_threshold=cache_threshold,
            balance_abs_threshold=balance_abs_threshold,
            balance_rel_threshold=balance_rel_threshold,
            max_tree_size=max_tree_size,
            chars_per_token=chars_per_token,
            **params,
        )
        check_param(self.name, "cache_threshold", cache_threshold, high=1)
        check_param(self.name, "balance_abs_threshold", balance_abs_threshold)
        check_param(self.name, "balance_rel_threshold", balance_rel_threshold)
        if max_tree_size is not None:  # None: the tree is never trimmed (ApproxTree's own default)
            check_param(self.name, "max_tree_size", max_tree_size, 1, whole=True)
        check_param(self.name, "chars_per_token", chars_per_token, 1, whole=True)
        self.cache_threshold = cache_threshold
        self.abs_t = balance_abs_threshold
        self.rel_t = balance_rel_threshold
        # SGLang's max_tree_size counts characters (its tree is over text); this tree counts tokens, so the
        # bound is converted, or it would keep chars_per_token times what SGLang keeps
        bound = None if max_tree_size is None else max(1, max_tree_size // chars_per_token)
        self.tree = RoutedTree(bound)

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
        first = best if match_rate(match[best], request) > self.cache_threshold else by_load[0]
        return [first] + [r for r in by_load if r != first]

    def on_routed(self, request, replica_id, view=None):
        super().on_routed(request, replica_id, view)
        self.tree.commit(request, replica_id)

    def on_unrouted(self, request, replica_id):
        """Take the prompt back out of the worker's tree: SGLang inserts only for the worker it sends to,
        so a withdrawn first choice must not keep it."""
        self.tree.withdraw(request, replica_id)

    def on_replica_removed(self, replica_id):
        self.tree.remove_replica(replica_id)
