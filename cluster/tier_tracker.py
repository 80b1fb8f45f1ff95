"""Keep the router's view of the host (LMCache L1) and shared (LMCache L2) tiers.

How the router learns what LMCache holds — by recording what the engines stored (docs/tiers.md
weighs the alternatives). LMCacheMPConnector writes every full chunk of a request's prompt through
to its node's LMCache server (L1, host memory) and the server writes it on to L2 (the shared tier).
So once a request's prefill has finished on a replica, the request's own prompt block hashes — the
router computed them, salt included — name blocks now held in that node's host tier and, when the
node has an L2, in the shared tier. No remote call, and the keys are exactly the router's keys.

Why not LMCache's own KV events: LMCacheMPConnector can publish CPU-medium BlockStored/BlockRemoved
through vLLM's event stream, but their hashes are LMCache chunk hashes (blake3 over tokens, no
salt), not vLLM block hashes, so they can never match a request in the index; this tracker drops
them (`apply_events`) instead of filling the index with keys nothing looks up.

What is modelled rather than observed: L1 capacity (an LRU per node of `host_capacity_blocks`,
parents outliving children as in vLLM's own pool), optional L2 capacity (`shared_capacity_blocks`; when
either is unknown, the index's own size bounds it), loss of the shared tier (`set_shared_up(False)` forgets every
shared entry: a restarted Redis is empty), a restarted node server (`node_restarted`: L1 lost) and a node
server that does not answer (`node_unanswering`: a frozen or cut-off node keeps its L1, so its model is
kept aside, unread, until the same server answers again).
Only whole LMCache chunks are stored, so a prompt counts up to its last full chunk
(`chunk_blocks` = LMCache chunk size / engine block size).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvmesh.cluster.block_cache import BlockLRU

LMCACHE_MEDIA = frozenset({"CPU"})


@dataclass
class _Kept:
    """A node's L1 model and settings, set aside while its server does not answer."""

    lru: BlockLRU
    chunk_blocks: int
    shared: bool


class TierTracker:
    """Index decorator: records prefills into host/shared residency; everything else is the index's."""

    def __init__(self, index, *, chunk_blocks: int = 1, shared_capacity_blocks: int | None = None):
        if chunk_blocks < 1:
            raise ValueError("chunk_blocks must be >= 1")
        self.index = index
        self.chunk_blocks = chunk_blocks
        self._host: dict[str, BlockLRU] = {}  # node id -> its L1 model (only nodes that run LMCache)
        self._chunk_blocks: dict[str, int] = {}  # node id -> LMCache chunk / engine block
        self._shared_nodes: set[str] = set()
        self._down: set[str] = set()  # nodes whose server is not serving: their engines' stats do not bring them back
        # nodes whose server does not answer: their L1 model, out of `_host` (nothing predicts from it) until the
        # same server answers again (`node_serving`); disjoint from `_host` and `_down`
        self._kept: dict[str, _Kept] = {}
        # a tier of unknown size is modelled no larger than the index (a Redis with maxmemory evicts without a
        # word to the router): the marks it drops are an under-estimate, and the router's memory stays bounded
        self._unknown_capacity = getattr(index, "max_blocks", None)
        self._shared = BlockLRU(shared_capacity_blocks or self._unknown_capacity)
        self.shared_up = True
        self.counters = dict.fromkeys(
            (
                "prefills_recorded",
                "host_marked",
                "host_evicted",
                "shared_marked",
                "shared_evicted",
                "shared_dropped_on_loss",
                "host_dropped_on_restart",
                "lmcache_events_dropped",
                "nodes_dropped",
                "nodes_unanswering",
                "nodes_restored",
            ),
            0,
        )

    def __getattr__(self, name):
        # match, add_replica, remove_replica, mark_stale, speculate, ... are the index's own.
        return getattr(self.index, name)

    def set_node(
        self,
        node_id: str,
        *,
        has_shared_tier: bool,
        host_capacity_blocks: int | None = None,
        chunk_blocks: int | None = None,
    ) -> None:
        """Declare that `node_id` runs an LMCache server (L1 of the given capacity; L2 or not).

        Idempotent (routers call it whenever routing stats arrive). Not while the node is down (`drop_node`):
        the stats say the engine was configured with a server, not that the server serves. While its server
        does not answer (`node_unanswering`), the kept model takes the settings but stays unread."""
        if node_id in self._down:
            return
        chunk = max(1, int(chunk_blocks or self.chunk_blocks))
        capacity = host_capacity_blocks if host_capacity_blocks is not None else self._unknown_capacity
        kept = self._kept.get(node_id)
        if kept is not None:
            kept.chunk_blocks, kept.lru.capacity, kept.shared = chunk, capacity, has_shared_tier
            return
        self._chunk_blocks[node_id] = chunk
        lru = self._host.get(node_id)
        if lru is None:
            self._host[node_id] = BlockLRU(capacity)
        else:
            lru.capacity = capacity
        (self._shared_nodes.add if has_shared_tier else self._shared_nodes.discard)(node_id)

    def record_prefill(self, replica_id: str, block_hashes: Sequence[int]) -> int:
        """A request's prefill finished on `replica_id`: its full-chunk prompt blocks are in L1 (and L2).

        Returns the number of blocks recorded (0 when the replica's node runs no LMCache server). A node whose
        server does not answer has its kept model kept in step (a prefill finished there, so its server stored
        it), but counts as no writer to the shared tier.
        """
        node = self.index.node_of(replica_id)
        lru = self._host.get(node)
        if lru is not None:
            k = self._chunk_blocks.get(node, self.chunk_blocks)
        elif node in self._kept:
            lru, k = self._kept[node].lru, self._kept[node].chunk_blocks
        else:
            return 0
        n = len(block_hashes) // k * k
        stored = list(block_hashes[:n])
        if not stored:
            return 0
        self.counters["prefills_recorded"] += 1
        _, evicted = lru.admit(stored)
        self.index.store_host(node, stored)
        if evicted:
            self.index.remove_host(node, evicted)
            self.counters["host_evicted"] += len(evicted)
        self.counters["host_marked"] += n
        if self.shared_up and node in self._shared_nodes:
            _, gone = self._shared.admit(stored)
            self.index.store_shared(stored)
            if gone:
                self.index.remove_shared(gone)
                self.counters["shared_evicted"] += len(gone)
            self.counters["shared_marked"] += n
        return n

    def stored_prefix(self, src_replica: str, dst_replica: str, n_blocks: int) -> int:
        """Of the first `n_blocks` blocks of a prompt whose prefill ran on `src_replica` (the whole prompt, or
        the part another prompt shares with it), those loadable on `dst_replica`: their whole LMCache chunks
        when both are on one node with an LMCache server, or when both nodes write to and read from the
        shared tier and it is up; else 0 (also when either replica has left the index: a request in flight
        on a replica that died stores nothing)."""
        if not (self.index.has_replica(src_replica) and self.index.has_replica(dst_replica)):
            return 0
        src, dst = self.index.node_of(src_replica), self.index.node_of(dst_replica)
        if src not in self._host or dst not in self._host:
            return 0
        if src != dst and not (self.shared_up and src in self._shared_nodes and dst in self._shared_nodes):
            return 0
        k = self._chunk_blocks.get(src, self.chunk_blocks)
        return n_blocks // k * k

    def loadable(
        self, matches: dict[str, tuple[int, int, int]], whole_chunks: bool = True
    ) -> dict[str, tuple[int, int, int]]:
        """The index's per-replica match (hbm, host-or-hbm, any tier, in blocks) as the engine will be given
        it. Why: the index holds tier residency per block, but LMCache keys a chunk by every token up to its
        end, so a prompt that leaves a stored prompt inside a chunk loads only the chunks before that point
        (seen live, 256-token chunks: a prompt sharing 11 blocks of 32 with one in the shared tier came back
        with 256 cached tokens, not 352). vLLM takes the longer of its own prefix and LMCache's, so each tier
        row is cut to whole chunks but never below the row above it. A replica whose node runs no LMCache
        server the router models (none, or one that failed) reads neither tier of LMCache; one whose node
        has no shared tier, or while the shared tier is down, reads no shared tier. `whole_chunks=False`
        keeps every block a reachable tier holds: what the chunk cut costs, for miss attribution. A node whose
        server does not answer counts as running none: the index still holds its kept host marks."""
        if not self._host and not self._kept and not self._down:  # no LMCache node at all: nothing to cut
            return matches
        out = {}
        for rid, (hbm, host, shared) in matches.items():
            # a replica forgotten since `matches` was taken (it left or died between ranking and placement)
            # is on no node any more: nothing beyond its own hbm, as with no server
            node = self.index.node_of(rid) if self.index.has_replica(rid) else None
            k = self._chunk_blocks.get(node) if node is not None else None
            if k is None:  # no LMCache server on its node: nothing beyond its own hbm
                out[rid] = (hbm, hbm, hbm)
                continue
            k = k if whole_chunks else 1
            host = max(hbm, host // k * k)
            if self.shared_up and node in self._shared_nodes:
                shared = max(host, shared // k * k)
            else:
                shared = host
            out[rid] = (hbm, host, shared)
        return out

    def set_shared_up(self, up: bool) -> None:
        """Shared tier reachable or not; losing it forgets all shared entries (they are gone or stale)."""
        if self.shared_up and not up:
            gone = self._shared.clear()
            self.index.remove_shared(gone)
            self.counters["shared_dropped_on_loss"] += len(gone)
        self.shared_up = up

    def node_restarted(self, node_id: str) -> None:
        """The node's LMCache server was restarted: its host memory tier is empty."""
        lru = self._kept[node_id].lru if node_id in self._kept else self._host.get(node_id)
        if lru is not None:
            gone = lru.clear()
            self.index.remove_host(node_id, gone)
            self.counters["host_dropped_on_restart"] += len(gone)

    def drop_node(self, node_id: str, down: bool = False) -> None:
        """The node left the cluster, or (`down`) its LMCache server does not serve: forget its host tier (also
        one kept while its server did not answer) and stop counting it as a writer to the shared tier. A node that
        comes back is declared anew by `set_node` when its engines' routing stats arrive; one that was down, only
        once `node_serving`."""
        if down:
            self._down.add(node_id)
        if node_id in self._kept:
            self.node_restarted(node_id)
            del self._kept[node_id]
            self.counters["nodes_dropped"] += 1
            return
        if node_id not in self._host:
            return
        self.node_restarted(node_id)
        del self._host[node_id]
        self._chunk_blocks.pop(node_id, None)
        self._shared_nodes.discard(node_id)
        self.counters["nodes_dropped"] += 1

    def forget_node(self, node_id: str) -> None:
        """The node left the cluster: `drop_node`, and nothing kept about it (down or not): node ids are new
        on every machine, and kept they would pile up for good."""
        self.drop_node(node_id)
        self._down.discard(node_id)

    def watched_nodes(self) -> set[str]:
        """Every node this tracker keeps something about: those it models, those whose server does not answer
        and those it holds down."""
        return set(self._host) | set(self._kept) | self._down

    def node_unanswering(self, node_id: str) -> None:
        """The node's server does not answer (a frozen or cut-off node): its host tier is likely intact but cannot
        be counted on, so nothing predicts from it and the node writes no shared entries, while its model is
        kept for `node_serving`. A node not modelled is held down, as by `drop_node`."""
        lru = self._host.pop(node_id, None)
        if lru is None:
            if node_id not in self._kept:
                self._down.add(node_id)
            return
        shared = node_id in self._shared_nodes
        self._shared_nodes.discard(node_id)
        self._kept[node_id] = _Kept(lru, self._chunk_blocks.pop(node_id, self.chunk_blocks), shared)
        self.counters["nodes_unanswering"] += 1

    def node_serving(self, node_id: str, *, intact: bool) -> None:
        """The node's server answers and serves: its engines' routing stats may declare it (`set_node`). A model
        kept while it did not answer is read again if `intact` (the same server process as before, so the same
        contents), else dropped: the node is declared anew, cold."""
        self._down.discard(node_id)
        kept = self._kept.get(node_id)
        if kept is None:
            return
        if not intact:
            self.drop_node(node_id)
            return
        del self._kept[node_id]
        self._host[node_id] = kept.lru
        self._chunk_blocks[node_id] = kept.chunk_blocks
        if kept.shared:
            self._shared_nodes.add(node_id)
        self.counters["nodes_restored"] += 1

    def unanswering_nodes(self) -> list[str]:
        """The nodes whose server does not answer, their host-tier model kept aside (`node_unanswering`)."""
        return sorted(self._kept)

    def any_node(self) -> bool:
        """Does any node run an LMCache server the router models?"""
        return bool(self._host)

    def nodes(self) -> dict[str, dict]:
        """node id -> {"host_blocks", "shared"}: the nodes whose tiers the router models now."""
        return {n: {"host_blocks": len(lru), "shared": n in self._shared_nodes} for n, lru in self._host.items()}

    def apply_events(self, replica_id: str, events: Iterable, medium_tiers: dict | None = None) -> int:
        """Forward engine KV events to the index, minus LMCache's chunk-hash events (see module doc)."""
        kept = []
        for ev in events:
            node = self.index.node_of(replica_id) if getattr(ev, "medium", None) in LMCACHE_MEDIA else None
            if node is not None and (node in self._host or node in self._kept):
                self.counters["lmcache_events_dropped"] += 1
                continue
            kept.append(ev)
        return self.index.apply_events(replica_id, kept, medium_tiers)

    @property
    def stats(self) -> dict:
        """The index's counters (a property there too) plus the tracker's own."""
        return {
            **self.index.stats,
            **{f"tier_{k}": v for k, v in self.counters.items()},
            "tier_shared_up": int(self.shared_up),
            "tier_shared_blocks": len(self._shared),
            "tier_host_blocks": sum(len(lru) for lru in self._host.values()),
            "tier_nodes_unanswering_now": len(self._kept),
        }
