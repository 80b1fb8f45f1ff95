"""The placement interface shared by the live router and the simulator.

A policy sees only plain data: the request's block hashes and, per candidate replica, how much of the
request's prefix that replica holds in each tier plus its load. It returns replica ids ranked best
first. Policies may keep private state (a peer's approximate tree, a round-robin counter) updated
through `on_routed` / `on_completed`; given the same seed and the same call sequence they are
deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

TIERS = ("hbm", "host", "shared")


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
    Arrays are numpy arrays of equal length; `extra` holds optional per-replica arrays."""

    ids: list
    hbm_blocks: "object"
    host_blocks: "object"
    shared_blocks: "object"
    queued: "object"
    running: "object"
    kv_usage: "object"
    pending_prefill_tokens: "object"
    capacity_blocks: "object"
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    def to_views(self) -> list[ReplicaView]:
        """One ReplicaView per replica (for policies without an array fast path)."""
        out = []
        for k, rid in enumerate(self.ids):
            out.append(ReplicaView(
                rid, int(self.hbm_blocks[k]), int(self.host_blocks[k]), int(self.shared_blocks[k]),
                int(self.queued[k]), int(self.running[k]), float(self.kv_usage[k]),
                int(self.pending_prefill_tokens[k]), int(self.capacity_blocks[k]),
                {name: arr[k] for name, arr in self.extra.items()}))
        return out


class Policy:
    """Base class: rank replicas best first. Subclasses override `rank`."""

    name = "base"
    # True when the policy needs per-tier prefix matches (lets callers skip the index lookup otherwise)
    uses_index = False

    def __init__(self, seed: int = 0, **params):
        self.seed = seed
        self.params = params

    def rank(self, request: RequestInfo, replicas: Sequence[ReplicaView]) -> list[str]:
        raise NotImplementedError

    def choose(self, request: RequestInfo, fleet: FleetView) -> int:
        """Index into `fleet.ids` of the best replica: the same decision as `rank(...)[0]`. Policies
        with an array fast path override this; the default ranks ReplicaViews built from the fleet."""
        best = self.rank(request, fleet.to_views())[0]
        return fleet.ids.index(best)

    def on_routed(self, request: RequestInfo, replica_id: str) -> None:
        """Called once the request was sent to `replica_id` (stateful peers learn from this)."""

    def on_unrouted(self, request: RequestInfo, replica_id: str) -> None:
        """Take back an `on_routed(request, replica_id)`. The live router credits its first choice as
        soon as it ranks (so requests ranked while Serve is still placing this one see it) and calls
        this when Serve placed the request elsewhere or ranked it again. Default: nothing to undo."""

    def on_completed(self, request: RequestInfo, replica_id: str) -> None:
        """Called when the request finished on `replica_id`."""

    def on_replica_removed(self, replica_id: str) -> None:
        """Forget anything kept about a replica that went away."""
