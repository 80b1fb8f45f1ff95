"""The placement interface shared by the live router and the simulator.

A policy sees only plain data: the request's block hashes and, per candidate replica, how much of the
request's prefix that replica holds in each tier plus its load. It returns replica ids ranked best
first.

One lifecycle, the same in the live router and the simulator: `place` ranks (pure: ranking the same
request twice on the same view gives the same order and changes nothing, since Serve may rank a
request several times while it backs off); `on_routed` records where a request went; `on_unrouted`
takes that back (the router commits to its first choice at once and moves the commitment if Serve
places the request elsewhere, ranks it again, or the client leaves); `on_replica_removed` forgets a
replica. Policies keep private state (a peer's approximate tree, a round-robin position, recent work)
changed only by those hooks; given the same seed and the same call sequence they are deterministic.
"""

from __future__ import annotations

import hashlib
import math
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

TIERS = ("hbm", "host", "shared")


def two_longest(shared_blocks) -> tuple[int, int]:
    """(the longest cached prefix any candidate holds, the longest two or more hold), in blocks. Where the
    first is longer, one replica alone holds the part between them: a conversation's own history, not a
    prompt shared across replicas. One candidate counts as both; none as (0, 0)."""
    import numpy as np

    held = np.asarray(shared_blocks)
    if len(held) < 2:
        only = int(held[0]) if len(held) else 0
        return only, only
    second, first = np.partition(held, len(held) - 2)[-2:]
    return int(first), int(second)


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a policy may know about one request."""

    block_hashes: Sequence[int]  # 64-bit chained hashes of the request's full blocks, in order
    num_tokens: int  # prompt length in tokens (may exceed len(block_hashes) * block_size)
    block_size: int
    expected_output_tokens: int = 0
    tenant: str | None = None
    request_id: str | None = None


@dataclass(slots=True)
class ReplicaView:
    """One replica as a policy sees it at decision time.

    Prefix lengths are in blocks and cumulative over tiers: `hbm_blocks` is the longest prefix held in
    the engine's own cache; `host_blocks` the longest prefix held in hbm or the node's host tier;
    `shared_blocks` the longest prefix reachable from hbm, host or the shared tier. So
    hbm_blocks <= host_blocks <= shared_blocks <= len(request.block_hashes).
    """

    replica_id: str
    hbm_blocks: int = 0
    host_blocks: int = 0
    shared_blocks: int = 0
    queued: int = 0  # requests waiting for their first token on that replica
    running: int = 0  # requests decoding on that replica
    kv_usage: float = 0.0  # fraction of the engine's KV cache in use, 0..1
    pending_prefill_tokens: int = 0  # uncached prompt tokens already sent there and not yet prefilled
    capacity_blocks: int = 0  # the engine's KV capacity in blocks (0 = unknown)
    extra: dict = field(default_factory=dict)


@dataclass(slots=True)
class FleetView:
    """Every candidate replica at once, as arrays (index k = replica `ids[k]`): the same fields as
    `ReplicaView`. Why: at hundreds of replicas, building one object per replica per request costs
    more than the decision; the simulator (and a large live fleet) hands policies this instead.
    Arrays are numpy arrays of equal length; `extra` holds optional per-replica arrays.

    `unseen_placements` says how stale the view is: how many free placements (ones not bound to the one
    replica holding their history) other routers (ingress replicas sharing the fleet) have made that this
    view does not include yet, because their placement stream arrives late
    (`kvmesh.deployments.peer_lag.UnseenPlacements`), and `unseen_tokens` the mean prefill work of a
    peer's placement. 0 for a lone router, or peers heard without lag.

    `inflight_blocks` (per replica, or None) is the longest prefix of the request each replica could load
    from a tier once a prefill in flight on another replica ends and is stored, and `inflight_ready_s`
    how many seconds from now that is: a replica lacking a new prompt that another replica is computing
    can take the request and hold it until then (`Policy.hold_worth`) instead of computing the prompt
    again. None where no tier will hold such a prefix."""

    ids: list
    hbm_blocks: np.ndarray
    host_blocks: np.ndarray
    shared_blocks: np.ndarray
    queued: np.ndarray
    running: np.ndarray
    kv_usage: np.ndarray
    pending_prefill_tokens: np.ndarray
    capacity_blocks: np.ndarray
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    unseen_placements: float = 0.0
    unseen_tokens: float = 0.0  # their mean prefill work (prompt tokens to compute)
    inflight_blocks: np.ndarray | None = None
    inflight_ready_s: float = 0.0

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def from_views(cls, views: Sequence[ReplicaView]) -> FleetView:
        """The same replicas as arrays (the router builds ReplicaViews; policies may want arrays)."""
        import numpy as np

        def col(field: str, dtype) -> np.ndarray:
            return np.fromiter((getattr(v, field) for v in views), dtype=dtype, count=len(views))

        extra = {}
        for name in {k for v in views for k in v.extra}:
            extra[name] = np.array([v.extra.get(name) for v in views], dtype=object)
        return cls(
            [v.replica_id for v in views],
            col("hbm_blocks", np.int64),
            col("host_blocks", np.int64),
            col("shared_blocks", np.int64),
            col("queued", np.int64),
            col("running", np.int64),
            col("kv_usage", np.float64),
            col("pending_prefill_tokens", np.int64),
            col("capacity_blocks", np.int64),
            extra,
        )

    def view(self, k: int) -> ReplicaView:
        """Replica `k` as a ReplicaView."""
        return ReplicaView(
            self.ids[k],
            int(self.hbm_blocks[k]),
            int(self.host_blocks[k]),
            int(self.shared_blocks[k]),
            int(self.queued[k]),
            int(self.running[k]),
            float(self.kv_usage[k]),
            int(self.pending_prefill_tokens[k]),
            int(self.capacity_blocks[k]),
            {name: arr[k] for name, arr in self.extra.items()},
        )

    def to_views(self) -> list[ReplicaView]:
        """One ReplicaView per replica (for policies without an array fast path)."""
        return [self.view(k) for k in range(len(self.ids))]


class Policy:
    """Base class. Subclasses override `rank` (a ranking of ReplicaViews) or `place` (the array form,
    for policies with a fast path); each default is written in terms of the other."""

    name = "base"
    # True when the policy needs per-tier prefix matches (lets callers skip the index lookup otherwise)
    uses_index = False

    def __init__(self, seed: int = 0, **params):
        self.seed = seed
        self.params = params
        self.routed = 0  # requests routed so far: seeds each request's tie-breaking draws

    def place(self, request: RequestInfo, fleet: FleetView) -> list[int]:
        """Indices into `fleet.ids`, best first: the entry point the router and the simulator call.
        Pure. The default ranks ReplicaViews built from the fleet."""
        pos = {rid: k for k, rid in enumerate(fleet.ids)}
        return [pos[rid] for rid in self.rank(request, fleet.to_views())]

    def rank(self, request: RequestInfo, replicas: Sequence[ReplicaView]) -> list[str]:
        """Replica ids, best first. Pure. The default places a FleetView built from the views."""
        if type(self).place is Policy.place:
            raise NotImplementedError(f"{type(self).__name__} overrides neither rank nor place")
        fleet = FleetView.from_views(replicas)
        return [fleet.ids[k] for k in self.place(request, fleet)]

    def best(self, request: RequestInfo, fleet: FleetView) -> int | None:
        """The first index `place` would return (None for an empty fleet). Policies with a cheaper way
        to find only the best replica override it; the simulator, which uses only that, calls this."""
        ranked = self.place(request, fleet)
        return ranked[0] if ranked else None

    def draws(self, request: RequestInfo) -> random.Random:
        """A random stream for this request's tie-breaks: fixed by the seed, the request and how many
        requests were routed before it, so ranking it again draws the same numbers."""
        key = f"{self.seed}:{self.routed}:{request.request_id}:{len(request.block_hashes)}"
        return random.Random(zlib.crc32(key.encode()))

    def prompt_pick(
        self, request: RequestInfo, ids: Sequence[str], weights: Sequence[float], known_blocks: int | None = None
    ) -> int:
        """An index into `ids` drawn with probability proportional to `weights`, fixed by the seed, the
        request's hashed prompt and the replica ids: weighted rendezvous hashing (each replica's own
        uniform u, the least -ln(u) / w wins). The prompt is keyed by the chained hash of its first block
        past `known_blocks` (the prefix some replica already holds), so requests that start the same new
        content (one new document, asked about twice) draw alike; without `known_blocks`, or with the
        whole prompt known, by its last full block (its id without one). The same key draws alike on
        every router whatever each routed before, and a small difference between two routers' weights
        rarely changes the winner, so routers that cannot see each other's latest placements still
        agree where new content goes; ranking again repeats."""
        hashes = request.block_hashes
        if known_blocks is not None and known_blocks < len(hashes):
            prefix = f"{self.seed}:{hashes[known_blocks]}:{known_blocks}:"
        else:
            tail = hashes[-1] if len(hashes) else request.request_id
            prefix = f"{self.seed}:{tail}:{len(hashes)}:{request.num_tokens}:"
        best, best_key = 0, math.inf
        for k, (rid, w) in enumerate(zip(ids, weights)):
            if not w > 0:
                continue
            # a cryptographic hash: CRC is affine, so its values for one replica set across prompts correlate
            u = (int.from_bytes(hashlib.blake2b((prefix + rid).encode(), digest_size=8).digest()) + 0.5) / 2**64
            key = -math.log(u) / w
            if key < best_key:
                best, best_key = k, key
        return best

    def hold_worth(self, missing_tokens: int, extra_wait_s: float) -> bool:
        """Should a request wait `extra_wait_s` longer for a prefix another replica is computing now, and
        then load its `missing_tokens` from the shared tier, instead of computing them on the replica it
        ranked first? Asked by the simulator and the live router only where a shared tier will hold that
        prefix once its prefill ends. Default: never (a policy places at once)."""
        return False

    def on_routed(self, request: RequestInfo, replica_id: str, view: ReplicaView | None = None) -> None:
        """The request was sent to `replica_id`; `view` is that replica as ranking saw it (prefix per
        tier, load), when the caller has it. Subclasses that override this call it too."""
        self.routed += 1

    def on_unrouted(self, request: RequestInfo, replica_id: str) -> None:
        """Take back an `on_routed(request, replica_id)`. The live router credits its first choice as
        soon as it ranks (so requests ranked while Serve is still placing this one see it) and calls
        this when Serve placed the request elsewhere or ranked it again. Default: nothing to undo."""

    def on_replica_added(self, replica_id: str) -> None:
        """A replica joined the fleet (the router saw it, or the simulator started)."""

    def on_replica_removed(self, replica_id: str) -> None:
        """Forget anything kept about a replica that went away."""
