"""Keep the router's view of the host and shared tiers, fed by the engines' own KV events.

How the router learns what LMCache holds (see docs/tiers.md for the alternatives weighed):
`LMCacheMPConnector` publishes, through vLLM's ordinary KV-event stream, a `BlockStored` with
medium "CPU" for every block LMCache stored in the node's host memory (L1) and a `BlockRemoved`
with medium "CPU" for every L1 eviction — with vLLM's own block hashes. `PrefixIndex.apply_events`
already maps medium "CPU" to the replica's node `host` tier, so host residency needs nothing else.

What no event says is the shared tier (L2): LMCache writes every L1 store through to L2 and emits
no L2 events. This tracker sits between the event subscriber and the index (it has the index's
`apply_events` signature) and, for replicas whose node has a shared tier, also marks each
CPU-stored block `shared`. L2 has no eviction events either, so its capacity is modelled as an LRU
of `shared_capacity_blocks` (None = unbounded, right for a Redis without maxmemory). When the shared
tier is reported down (`set_shared_up(False)`, from the node server's health probe) every shared
entry is dropped — a Redis restart comes back empty — and nothing is marked shared until it is up.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from cluster.index import event_hash

HOST_MEDIA = frozenset({"CPU"})


class TierTracker:
    """Index decorator: forwards KV events to `index` and derives shared-tier residency from them."""

    def __init__(self, index, *, shared_capacity_blocks: int | None = None):
        self.index = index
        self.shared_capacity_blocks = shared_capacity_blocks
        self._shared_nodes: set[str] = set()  # nodes whose LMCache server writes through to L2
        self._shared_lru: OrderedDict[int, None] = OrderedDict()
        self.shared_up = True
        self.counters = {"host_stored": 0, "host_removed": 0, "shared_marked": 0, "shared_evicted": 0,
                         "shared_dropped_on_loss": 0}

    def __getattr__(self, name):
        # Everything else (match, add_replica, mark_stale, clear, stats...) is the index's own.
        return getattr(self.index, name)

    def set_node_shared(self, node_id: str, has_shared_tier: bool = True) -> None:
        """Declare whether `node_id`'s LMCache server has an L2 (from its tier config)."""
        (self._shared_nodes.add if has_shared_tier else self._shared_nodes.discard)(node_id)

    def set_shared_up(self, up: bool) -> None:
        """Shared tier reachable or not; losing it forgets all shared entries (they are gone or stale)."""
        if self.shared_up and not up:
            self.counters["shared_dropped_on_loss"] += len(self._shared_lru)
            self.index.remove_shared(list(self._shared_lru))
            self._shared_lru.clear()
        self.shared_up = up

    def apply_events(self, replica_id: str, events: Iterable, medium_tiers: dict | None = None) -> int:
        events = list(events)
        applied = self.index.apply_events(replica_id, events, medium_tiers)
        shared_ok = self.shared_up and self.index.node_of(replica_id) in self._shared_nodes
        for ev in events:
            kind = type(ev).__name__
            if getattr(ev, "medium", None) not in HOST_MEDIA or getattr(ev, "group_idx", None) not in (None, 0):
                continue
            if kind == "BlockStored":
                self.counters["host_stored"] += len(ev.block_hashes)
                if shared_ok:
                    self._mark_shared([event_hash(h) for h in ev.block_hashes])
            elif kind == "BlockRemoved":
                self.counters["host_removed"] += len(ev.block_hashes)
        return applied

    def _mark_shared(self, hashes: list[int]) -> None:
        lru = self._shared_lru
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        self.index.store_shared(hashes)
        self.counters["shared_marked"] += len(hashes)
        cap = self.shared_capacity_blocks
        if cap is not None and len(lru) > cap:
            victims = [lru.popitem(last=False)[0] for _ in range(len(lru) - cap)]
            self.index.remove_shared(victims)
            self.counters["shared_evicted"] += len(victims)

    @property
    def stats(self) -> dict:
        """The index's counters (a property there too) plus the tracker's own."""
        return {**self.index.stats, **{f"tier_{k}": v for k, v in self.counters.items()},
                "tier_shared_up": int(self.shared_up), "tier_shared_blocks": len(self._shared_lru)}
