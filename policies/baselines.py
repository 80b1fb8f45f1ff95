"""Cache-blind baselines: what placement achieves without knowing where KV blocks live.

They bracket every cache-aware result: round robin / random show the hit rate a fleet gets by
accident (about 1/N of the reusable prefix), least-loaded and power-of-two the best balance without
affinity, consistent hashing the best affinity without balance.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from kvmesh.policies.base import Policy, ReplicaView, RequestInfo
from kvmesh.policies.cost_model import check_param

MAX_VNODES = 10_000  # ring points per replica: a ring of vnodes x replicas is rebuilt whenever the fleet changes


def outstanding(v: ReplicaView) -> int:
    """Requests a replica has not finished: the load signal every load-based router uses."""
    return v.queued + v.running


class RoundRobin(Policy):
    """Each request to the next replica in turn (the order of the `replicas` argument)."""

    name = "round_robin"

    def rank(self, request: RequestInfo, replicas: Sequence[ReplicaView]) -> list[str]:
        if not replicas:
            return []
        n = len(replicas)
        start = self.routed % n  # the position moves when a request is routed, not when it is ranked
        return [replicas[(start + i) % n].replica_id for i in range(n)]

    def place(self, request, fleet) -> list[int]:
        n = len(fleet)
        start = self.routed % n if n else 0
        return [(start + i) % n for i in range(n)]


class RandomChoice(Policy):
    """A seeded random permutation per request."""

    name = "random"

    def rank(self, request: RequestInfo, replicas: Sequence[ReplicaView]) -> list[str]:
        ids = [v.replica_id for v in replicas]
        self.draws(request).shuffle(ids)
        return ids


class LeastLoaded(Policy):
    """Fewest outstanding requests first; ties broken by a rotating offset (not always replica 0)."""

    name = "least_loaded"

    def rank(self, request: RequestInfo, replicas: Sequence[ReplicaView]) -> list[str]:
        if not replicas:
            return []
        n = len(replicas)
        turn = self.routed + 1
        order = sorted(
            range(n), key=lambda i: (outstanding(replicas[i]), replicas[i].pending_prefill_tokens, (i - turn) % n)
        )
        return [replicas[i].replica_id for i in order]


class PowerOfTwo(Policy):
    """Sample two replicas at random, prefer the less loaded (Mitzenmacher); the rest follow by load."""

    name = "power_of_two"

    def rank(self, request: RequestInfo, replicas: Sequence[ReplicaView]) -> list[str]:
        if not replicas:
            return []
        n = len(replicas)
        if n == 1:
            return [replicas[0].replica_id]
        a, b = self.draws(request).sample(range(n), 2)
        pair = sorted((a, b), key=lambda i: outstanding(replicas[i]))
        rest = sorted((i for i in range(n) if i not in (a, b)), key=lambda i: outstanding(replicas[i]))
        return [replicas[i].replica_id for i in pair + rest]


def _ring_point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class ConsistentHash(Policy):
    """Hash ring over replicas (`vnodes` points each) keyed by the request's FIRST block hash, so
    everything sharing a first block (a system prompt, a tenant) lands on one replica. Replicas are
    ranked in ring order from that point, which is also the failover order."""

    name = "consistent_hash"

    def __init__(self, seed: int = 0, vnodes: int = 64, **params):
        super().__init__(seed, vnodes=vnodes, **params)
        check_param(self.name, "vnodes", vnodes, 1, MAX_VNODES, whole=True)  # 0: an empty ring, no replica found
        self.vnodes = vnodes
        self._members: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _rebuild(self, ids: tuple[str, ...]) -> None:
        ring = sorted((_ring_point(f"{self.seed}:{rid}#{v}"), rid) for rid in ids for v in range(self.vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [r for _, r in ring]
        self._members = ids

    def rank(self, request: RequestInfo, replicas: Sequence[ReplicaView]) -> list[str]:
        if not replicas:
            return []
        ids = tuple(sorted(v.replica_id for v in replicas))
        if ids != self._members:
            self._rebuild(ids)
        key = request.block_hashes[0] if request.block_hashes else f"id:{request.request_id}"
        start = bisect.bisect(self._points, _ring_point(f"k{key}")) % len(self._points)
        seen: dict[str, None] = {}
        n = len(self._owners)
        for i in range(n):
            seen.setdefault(self._owners[(start + i) % n])
            if len(seen) == len(ids):
                break
        return list(seen)
