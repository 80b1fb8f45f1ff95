"""Ray Serve's `PrefixCacheAffinityRouter`, re-implemented from its source for comparison.

Source: ray 2.60.0 (commit b7f4259) `ray/llm/_internal/serve/routing_policies/prefix_aware/prefix_aware_router.py`
and `prefix_tree.py` (read in the installed wheel), and doc/source/serve/advanced-guides/prefix-aware-request-router.md.
Taken: (1) if max - min replica queue length > imbalanced_threshold (default: infinity, i.e. never),
fall back to power of two choices; (2) else match the prompt in a prefix tree fed at routing time
(`on_request_routed` inserts the prompt); if the match rate (`len(matched_text) / len(input_text)`, here
matched blocks x block size / prompt tokens, the partial last block counted in the length) >=
match_rate_threshold (0.1) the candidates are the replicas with the longest match, else the replicas with
the smallest tree ("smallest tenants"); (3) Serve sends to the least-queued candidate. Eviction is off by
default (`do_eviction=False`): the tree keeps every prompt routed. With `do_eviction=True` a replica's tree
over eviction_threshold_chars (400,000) is cut, least recently used first, to eviction_target_chars
(360,000); here 4 characters per token turn those into tokens. The tree holds a prompt only for the replica
the request went to: the live router's withdrawn first choices are taken back out (`on_unrouted`).
Differences: the tree is over block hashes, not characters, so matching stops at block boundaries (a shared
prefix ending mid-block counts only its full blocks, and a prompt shorter than one block never matches: a
policy sees only full blocks' hashes); the eviction check runs at each insertion instead of every
eviction_interval_secs (10 s), since a policy has no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.policies.base import Policy, ReplicaView, RequestInfo
from kvmesh.policies.baselines import outstanding
from kvmesh.policies.cost_model import check_flag, check_param
from kvmesh.policies.routed_tree import RoutedTree
from kvmesh.policies.sglang_cache_aware import match_rate


def prompt_tree(do_eviction: bool, threshold_chars: int, target_chars: int, chars_per_token: int) -> RoutedTree:
    """The router's prefix tree: unbounded unless eviction is on, then cut from the threshold to the target."""
    if not do_eviction:
        return RoutedTree(None)
    threshold = max(1, threshold_chars // chars_per_token)
    return RoutedTree(threshold, min(max(0, target_chars // chars_per_token), threshold))


class RayPrefixAffinity(Policy):
    name = "ray_prefix_affinity"

    def __init__(
        self,
        seed: int = 0,
        imbalanced_threshold: float = float("inf"),
        match_rate_threshold: float = 0.1,
        do_eviction: bool = False,
        eviction_threshold_chars: int = 400_000,
        eviction_target_chars: int = 360_000,
        chars_per_token: int = 4,
        **params,
    ):
        super().__init__(
            seed,
            imbalanced_threshold=imbalanced_threshold,
            match_rate_threshold=match_rate_threshold,
            do_eviction=do_eviction,
            eviction_threshold_chars=eviction_threshold_chars,
            eviction_target_chars=eviction_target_chars,
            **params,
        )
        if imbalanced_threshold != float("inf"):  # infinity, the default: never fall back
            check_param(self.name, "imbalanced_threshold", imbalanced_threshold)
        check_param(self.name, "match_rate_threshold", match_rate_threshold, high=1)
        check_flag(self.name, "do_eviction", do_eviction)
        check_param(self.name, "eviction_threshold_chars", eviction_threshold_chars, 1, whole=True)
        check_param(self.name, "eviction_target_chars", eviction_target_chars, whole=True)
        check_param(self.name, "chars_per_token", chars_per_token, 1, whole=True)
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.tree = prompt_tree(do_eviction, eviction_threshold_chars, eviction_target_chars, chars_per_token)

    def _pow2(self, replicas, rng):
        n = len(replicas)
        if n == 1:
            return [replicas[0]]
        return [replicas[i] for i in rng.sample(range(n), 2)]

    def rank(self, request: RequestInfo, replicas: Sequence[ReplicaView]) -> list[str]:
        rng = self.draws(request)
        if not replicas:
            return []
        q = {v.replica_id: outstanding(v) for v in replicas}
        ids = list(q)
        candidates = None
        if max(q.values()) - min(q.values()) <= self.imbalanced_threshold:
            match = self.tree.match(request.block_hashes, ids)
            best = max(match.values())
            rate = match_rate(best, request)
            if rate >= self.match_rate_threshold and best > 0:
                candidates = [r for r in ids if match[r] == best]
            else:
                smallest = min(self.tree.size(r) for r in ids)
                candidates = [r for r in ids if self.tree.size(r) == smallest]
        if not candidates:
            candidates = [v.replica_id for v in self._pow2(replicas, rng)]
        rng.shuffle(candidates)  # Serve breaks queue-length ties randomly
        first = min(candidates, key=lambda r: q[r])
        return [first] + sorted((r for r in ids if r != first), key=lambda r: q[r])

    def on_routed(self, request, replica_id, view=None):
        super().on_routed(request, replica_id, view)
        self.tree.commit(request, replica_id)

    def on_unrouted(self, request, replica_id):
        """Take the prompt back out of the replica's tree: Serve inserts only for the replica the request
        was sent to, so a withdrawn first choice must not keep it."""
        self.tree.withdraw(request, replica_id)

    def on_replica_removed(self, replica_id):
        self.tree.remove_replica(replica_id)
