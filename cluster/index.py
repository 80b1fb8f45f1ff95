"""PrefixIndex: which replica holds which KV block, per tier, answered in one pass over a request.

Why this shape: the router decides on every request, in its own process, so the lookup must be a few
hundred dict probes and integer ANDs, not a tree walk or a remote call. Replicas are bit positions
("slots"); each indexed block hash maps to one small immutable entry
`(hbm_mask, host_node_mask, shared)` (a tuple of ints, invisible to the garbage collector):

- `hbm`  — per replica (the engine's own paged cache), a bitmask over replica slots;
- `host` — per node (LMCache L1 / host DRAM): every replica on that node can load it, so the entry
  keeps a bitmask over node slots that `match` widens to the node's replicas;
- `shared` — global (LMCache L2): any replica can load it.

Walking the request's hashes in order with `alive &= mask` gives each replica's longest cached prefix
per tier; a replica drops out at the first block it lacks, and the walk stops when no replica is alive
in any tier. Prefix lengths are cumulative (hbm <= host-or-hbm <= any tier), as `kvmesh.policies.base`
expects.

Memory is bounded by `max_blocks` entries in LRU order (touched on store and on a matching lookup, a
request's blocks last-to-first, so a chain's head outlives its tail and an eviction shortens a cached prefix
instead of cutting it off at its first block).
Speculative entries (written when a request is routed, before the engine's BlockStored arrives)
expire after `speculative_ttl_s` unless an event confirms them. Keys are the 64-bit event form of
vLLM's block hashes (`kvmesh.kvstore.hashing.block_hashes`). Not thread-safe: one asyncio loop owns it.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

log = logging.getLogger(__name__)

TIERS = ("hbm", "host", "shared")
_MASK64 = (1 << 64) - 1

# vLLM KV-event `medium` -> tier. The engine's own block pool reports "GPU" (also on CPU builds, where
# that cache lives in host RAM but is still the engine's private paged cache) or None (older
# versions). vLLM's native offloading reports "CPU" (host RAM) and "STORAGE" (local disk): buffers of that
# one engine process, which its node's other replicas cannot load, so they map to `offload`: a host tier of
# the replica's own (kept like a node's, with that replica as its only member).
# Events with locality "REMOTE" describe a store reachable from other nodes: `shared`.
# LMCacheMPConnector's CPU events carry LMCache chunk hashes, not vLLM block hashes, so they never
# match a request: cluster/tier_tracker.py drops them and feeds host/shared from routed prefills.
MEDIUM_TIERS: dict[str | None, str] = {None: "hbm", "GPU": "hbm", "CPU": "offload", "STORAGE": "offload"}

_COUNTERS = (
    "admissions",
    "evictions",
    "lookups",
    "lookup_blocks",
    "hits",
    "hit_blocks",
    "speculative_writes",
    "speculative_expired",
    "speculative_confirmed",
    "speculative_withdrawn",
    "events_applied",
    "events_ignored",
    "block_size_mismatch",
    "replicas_stale",
)


def event_hash(h: int | bytes) -> int:
    """The 64-bit key of a hash as events carry it (bytes when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    if isinstance(h, int):
        return h & _MASK64
    return int.from_bytes(h, "big") & _MASK64


def _last_first(hashes: Iterable[int]):
    """A request's hashes last to first: stored in that order, a chain's head is its most recently used block."""
    return reversed(hashes if isinstance(hashes, (list, tuple)) else list(hashes))


def _bits(mask: int):
    """Yield the set bit positions of `mask`."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _scatter(row, mask: int, value: int, n_slots: int) -> None:
    """row[s] = value for each set bit s of `mask`: bit by bit for a few, unpacked for many."""
    if mask.bit_count() <= 8:
        while mask:
            low = mask & -mask
            row[low.bit_length() - 1] = value
            mask ^= low
        return
    import numpy as np

    raw = np.frombuffer(mask.to_bytes((n_slots + 7) // 8, "little"), dtype=np.uint8)
    row[np.unpackbits(raw, bitorder="little")[:n_slots].astype(bool)] = value


class _Slots:
    """Slot numbers, the lowest free one first, so bitmasks stay as narrow as the fleet. Why a heap of freed
    slots below a counter, not a scan from 0: the scan made adding N replicas (or nodes) cost O(N^2)."""

    __slots__ = ("_freed", "_next")

    def __init__(self) -> None:
        self._freed: list[int] = []  # min-heap of given-back slots, each below _next
        self._next = 0  # every slot from here up is free

    def take(self) -> int:
        if self._freed:
            return heapq.heappop(self._freed)
        self._next += 1
        return self._next - 1

    def give(self, slot: int) -> None:
        heapq.heappush(self._freed, slot)


class PrefixIndex:
    """Block hash -> residency per tier; `match` returns per-replica cumulative prefix lengths."""

    def __init__(
        self,
        max_blocks: int = 2_000_000,
        speculative_ttl_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        block_size: int | None = None,
    ):
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        # the block size the router hashes requests with: a BlockStored of another size names keys no request
        # ever looks up, so it is counted (`block_size_mismatch`) and left out. None: not checked
        self.block_size = block_size
        self._block_size_warned: set[str] = set()
        self.speculative_ttl_s = speculative_ttl_s
        self._clock = clock
        self._entries: OrderedDict[int, tuple[int, int, int]] = OrderedDict()  # hash -> (hbm, host_nodes, shared)
        # replicas
        self._slot: dict[str, int] = {}
        self._slot_rid: dict[int, str] = {}
        self._slots = _Slots()
        self._replica_node: dict[str, int] = {}
        self._all = 0  # OR of every registered replica's bit
        # replica slot -> {hash: None} with its hbm bit set (dicts of ints, unlike sets, are not GC-tracked)
        self._held: dict[int, dict[int, None]] = {}
        # nodes
        self._node_slot: dict[str, int] = {}
        self._node_name: dict[int, str] = {}  # node slot -> node id
        self._node_slots = _Slots()
        self._node_members: dict[int, int] = {}  # node slot -> replica bitmask
        self._node_held: dict[int, dict[int, None]] = {}  # node slot -> {hash: None} in its host tier
        self._widen: dict[int, int] = {}  # cache: host node mask -> replica mask
        # replica id -> node slot of its own offload tier (vLLM native offloading), made when first stored to
        self._own_node: dict[str, int] = {}
        # speculation
        # replica slot -> hash -> (expiry, mark, claims) of each speculative mark: `claims` counts the requests
        # placed there that count on it (`speculate`), so one request's `withdraw` leaves a mark another still
        # counts on; `mark` numbers each mark, so a claim on an earlier mark of the same block (confirmed,
        # removed, marked anew since) takes nothing back
        self._spec: dict[int, dict[int, tuple[float, int, int]]] = {}
        self._marks = 0
        self._spec_queue: deque[tuple[float, int, tuple[int, ...]]] = deque()
        self._stale: set[str] = set()
        self._c = dict.fromkeys(_COUNTERS, 0)
        # set once anything is stored in a host or shared tier: until then every entry is hbm-only and
        # `match_hbm_array` may walk the hbm masks alone
        self._tiered = False

    # ---------------------------------------------------------------- replicas and nodes
    def add_replica(self, replica_id: str, node_id: str = "node-0") -> None:
        """Register a replica (idempotent); its node's host tier becomes visible to it."""
        if replica_id in self._slot:
            if self._node_of(replica_id) == node_id:
                return
            self.remove_replica(replica_id)
        slot = self._slots.take()
        self._slot[replica_id] = slot
        self._slot_rid[slot] = replica_id
        self._held[slot] = {}
        self._spec[slot] = {}
        nslot = self._ensure_node(node_id)
        self._replica_node[replica_id] = nslot
        self._node_members[nslot] |= 1 << slot
        self._all |= 1 << slot
        self._widen.clear()

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica and everything only it held in hbm (its node's host tier stays)."""
        slot = self._slot.pop(replica_id, None)
        if slot is None:
            return
        self._clear_slot(slot)
        del self._slot_rid[slot], self._held[slot], self._spec[slot]
        self._slots.give(slot)
        nslot = self._replica_node.pop(replica_id)
        self._node_members[nslot] &= ~(1 << slot)
        own = self._own_node.pop(replica_id, None)
        if own is not None:  # its offload buffer lived in its process
            self._node_members[own] = 0
            self.remove_node(self._node_name[own])
        self._all &= ~(1 << slot)
        self._stale.discard(replica_id)
        self._block_size_warned.discard(replica_id)
        self._widen.clear()

    def remove_node(self, node_id: str) -> None:
        """Forget a node no replica is on any more: its host tier and its slot. Why: node ids are new on every
        machine an autoscaler brings, and kept they would widen every host mask for good; and blocks vLLM
        offloaded to the node's host memory lived in its engines' processes, gone with them."""
        nslot = self._node_slot.get(node_id)
        if nslot is None or self._node_members[nslot]:
            return
        self._remove_node(nslot, list(self._node_held[nslot]))
        del self._node_slot[node_id], self._node_name[nslot], self._node_members[nslot], self._node_held[nslot]
        self._node_slots.give(nslot)
        self._widen.clear()

    def nodes(self) -> list[str]:
        """The nodes (not the replicas' own offload tiers)."""
        own = {self._node_name[n] for n in self._own_node.values()}
        return [n for n in self._node_slot if n not in own]

    def replicas(self) -> list[str]:
        return list(self._slot)

    def has_replica(self, replica_id: str) -> bool:
        return replica_id in self._slot

    def node_of(self, replica_id: str) -> str:
        return self._node_of(replica_id)

    def held_blocks(self, replica_id: str) -> int:
        """How many blocks the index believes `replica_id` holds in hbm (speculative included)."""
        return len(self._held[self._slot[replica_id]])

    # ---------------------------------------------------------------- writes
    def store(self, replica_id: str, hashes: Iterable[int], tier: str = "hbm") -> None:
        """Record blocks held by a replica; tier "host" stores them in that replica's node tier, "offload" in
        the replica's own (vLLM native offloading: loadable by that replica alone)."""
        if tier == "hbm":
            self._store_hbm(self._require(replica_id), hashes)
        elif tier == "host":
            self._store_node(self._replica_node[self._require_rid(replica_id)], hashes)
        elif tier == "offload":
            self._store_node(self._offload_node(replica_id), hashes)
        elif tier == "shared":
            self.store_shared(hashes)
        else:
            raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")

    def remove(self, replica_id: str, hashes: Iterable[int], tier: str = "hbm") -> None:
        if tier == "hbm":
            self._remove_hbm(self._require(replica_id), hashes)
        elif tier == "host":
            self._remove_node(self._replica_node[self._require_rid(replica_id)], hashes)
        elif tier == "offload":
            own = self._own_node.get(self._require_rid(replica_id))
            if own is not None:
                self._remove_node(own, hashes)
        elif tier == "shared":
            self.remove_shared(hashes)
        else:
            raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")

    def clear(self, replica_id: str, tier: str = "hbm") -> None:
        """Drop everything a replica holds in `tier` (AllBlocksCleared, a reset, a gap)."""
        if tier == "hbm":
            self._clear_slot(self._require(replica_id))
        elif tier == "host":
            nslot = self._replica_node[self._require_rid(replica_id)]
            self._remove_node(nslot, list(self._node_held[nslot]))
        elif tier == "shared":
            self.remove_shared([h for h, e in self._entries.items() if e[2]])
        else:
            raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")

    def store_host(self, node_id: str, hashes: Iterable[int]) -> None:
        self._store_node(self._ensure_node(node_id), hashes)

    def remove_host(self, node_id: str, hashes: Iterable[int]) -> None:
        if node_id in self._node_slot:
            self._remove_node(self._node_slot[node_id], hashes)

    def store_shared(self, hashes: Iterable[int]) -> None:
        self._tiered = True
        for h in _last_first(hashes):
            self._or(h, 2, 1)
        self._trim()

    def remove_shared(self, hashes: Iterable[int]) -> None:
        entries = self._entries
        for h in hashes:
            if h in entries:
                self._andnot(h, 2, 1)

    def speculate(self, replica_id: str, hashes: Sequence[int], fresh: list[tuple[int, int]] | None = None) -> int:
        """Mark blocks as (about to be) in a replica's hbm, expiring unless a BlockStored confirms.

        Returns how many blocks were marked (or marked again). Blocks already confirmed there are left
        alone. `fresh`, if given, receives the request's claims on its marks, new or shared with other
        requests placed there: what `withdraw` gives back. Without it the marks stay until they expire.
        Expired marks are dropped first, so a router that only hears placements (its peers') keeps
        no more than a time to live's worth of them.
        """
        if self._spec_queue:
            self.expire()
        slot = self._require(replica_id)
        bit = 1 << slot
        expiry = self._clock() + self.speculative_ttl_s
        spec = self._spec[slot]
        held = self._held[slot]
        written = []
        claims = []
        for h in reversed(hashes):  # last-to-first: the chain's head is the most recently used (module doc)
            if self._or(h, 0, bit) and h not in spec:
                continue  # confirmed by a real event already
            earlier = spec.get(h)
            mark, n = (earlier[1], earlier[2]) if earlier else self._new_mark()
            spec[h] = (expiry, mark, n + 1)
            claims.append((h, mark))
            held[h] = None
            written.append(h)
        self._trim()  # after the whole chain is touched: evicting amid it could take the chain's own head
        if fresh is not None:
            fresh.extend(reversed(claims))
        if written:
            self._spec_queue.append((expiry, slot, tuple(written)))
            self._c["speculative_writes"] += len(written)
        return len(written)

    def withdraw(self, replica_id: str, fresh: Iterable[tuple[int, int]]) -> int:
        """Give back a request's claims (`speculate`'s `fresh`) on a replica it did not go to, or no longer
        counts on: a speculative mark (never confirmed by an event) goes when no request claims it any
        more. Returns how many marks were dropped."""
        slot = self._slot.get(replica_id)
        if slot is None:
            return 0
        spec = self._spec[slot]
        gone = []
        for h, mark in fresh:
            entry = spec.get(h)
            if entry is None or entry[1] != mark:
                continue  # confirmed, removed or expired since (and perhaps marked anew: another's mark)
            if entry[2] > 1:
                spec[h] = (entry[0], mark, entry[2] - 1)
            else:
                gone.append(h)
        self._remove_hbm(slot, gone)
        self._c["speculative_withdrawn"] += len(gone)
        return len(gone)

    # ---------------------------------------------------------------- events
    def apply_events(self, replica_id: str, events: Iterable, medium_tiers: dict | None = None) -> int:
        """Apply decoded vLLM KV events (BlockStored / BlockRemoved / AllBlocksCleared) for a replica.

        Accepts `kvmesh.cluster.kv_events` records or vLLM's own msgspec structs (matched by class name).
        Only KV-cache group 0 counts (the full-attention group routing cares about); events for an
        unknown medium or another group are counted in `events_ignored`. With `block_size` set, a
        BlockStored of another block size is ignored too (its hashes cover other token spans than the
        router's, so no request would ever match them). Only the engine's own GPU prefix blocks (hbm
        tier, block_size > 0) count in `block_size_mismatch`, with a warning once per replica: the
        engine's block size differs from the router's. Others are only counted in `events_ignored`:
        LMCache chunk events (a host tier, block_size = its chunk size), vLLM offloading's placeholder
        (block_size 0). Returns events applied.
        """
        tiers = MEDIUM_TIERS if medium_tiers is None else medium_tiers
        self._require(replica_id)
        applied = 0
        for ev in events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                self.clear(replica_id, "hbm")
                applied += 1
                continue
            if kind not in ("BlockStored", "BlockRemoved") or getattr(ev, "group_idx", None) not in (None, 0):
                self._c["events_ignored"] += 1
                continue
            tier = "shared" if getattr(ev, "locality", None) == "REMOTE" else tiers.get(ev.medium)
            if tier is None:
                self._c["events_ignored"] += 1
                continue
            hashes = [event_hash(h) for h in ev.block_hashes]
            if kind == "BlockStored":
                size = getattr(ev, "block_size", None)
                if size is not None and self.block_size is not None and size != self.block_size:
                    if tier == "hbm" and size > 0:
                        self._block_size_mismatch(replica_id, size)
                    else:  # never a prefix block a request could match: not the engine's block size at fault
                        self._c["events_ignored"] += 1
                    continue
                self.store(replica_id, hashes, tier)
            else:
                self.remove(replica_id, hashes, tier)
            applied += 1
        self._c["events_applied"] += applied
        return applied

    def _block_size_mismatch(self, replica_id: str, size: int) -> None:
        self._c["events_ignored"] += 1
        self._c["block_size_mismatch"] += 1
        if replica_id not in self._block_size_warned:
            self._block_size_warned.add(replica_id)
            log.warning(
                "replica %s publishes KV blocks of %d tokens, the router hashes requests in blocks of %d: its "
                "events are ignored and no request will find its cache (set the same block_size on both)",
                replica_id,
                size,
                self.block_size,
            )

    def mark_stale(self, replica_id: str) -> None:
        """The event stream of a replica had a gap: forget its hbm view until it is rebuilt."""
        if replica_id not in self._slot:
            return
        self._clear_slot(self._slot[replica_id])
        own = self._own_node.get(replica_id)
        if own is not None:  # its offload tier is known from the same events
            self._remove_node(own, list(self._node_held[own]))
        self._stale.add(replica_id)
        self._c["replicas_stale"] += 1

    def mark_fresh(self, replica_id: str) -> None:
        self._stale.discard(replica_id)

    def is_stale(self, replica_id: str) -> bool:
        return replica_id in self._stale

    # ---------------------------------------------------------------- lookup
    def match(self, hashes: Sequence[int]) -> dict[str, tuple[int, int, int]]:
        """Per registered replica: (hbm, host-or-hbm, any-tier) longest cached prefix, in blocks."""
        i, drops = self._walk(hashes)
        lens: tuple[dict[int, int], dict[int, int], dict[int, int]] = ({}, {}, {})
        for tier, pos, mask in drops:
            d = lens[tier]
            for s in _bits(mask):
                d[s] = pos
        dh, do, ds = lens
        return {rid: (dh.get(s, i), do.get(s, i), ds.get(s, i)) for rid, s in self._slot.items()}

    def match_arrays(self, hashes: Sequence[int], n_slots: int | None = None):
        """`match` as a (3, n_slots) int64 numpy array indexed by replica slot (`slot_of`).

        Rows: hbm, host-or-hbm, any tier. For large fleets (simulator, hundreds of replicas) where
        building a dict of tuples costs more than the walk; unregistered slots read 0 and must be
        ignored by the caller. Why it starts from zeros: most replicas lack a request's first block,
        so only the few that drop later, or hold the whole walk, are written.
        """
        import numpy as np

        if n_slots is None:
            n_slots = max(self._slot_rid, default=-1) + 1
        i, drops = self._walk(hashes)
        out = np.zeros((3, n_slots), dtype=np.int64)
        if not i:
            return out
        gone = [0, 0, 0]
        for tier, pos, mask in drops:  # each slot leaves each tier at most once
            gone[tier] |= mask
            if pos:
                _scatter(out[tier], mask, pos, n_slots)
        for tier in range(3):
            alive = self._all & ~gone[tier]
            if alive:
                _scatter(out[tier], alive, i, n_slots)
        return out

    def match_hbm_array(self, hashes: Sequence[int], n_slots: int | None = None):
        """`match_arrays(hashes, n_slots)[0]` (the hbm row alone), with the same side effects (counters,
        LRU touches). While nothing was ever stored in a host or shared tier, every entry is hbm-only,
        so the three rows are equal and the walk follows one mask instead of three (the simulator
        without tiers, hundreds of replicas: a third of the bit work and of the writes)."""
        import numpy as np

        if self._tiered:
            return self.match_arrays(hashes, n_slots)[0]
        if n_slots is None:
            n_slots = max(self._slot_rid, default=-1) + 1
        self._begin_lookup(hashes)
        get = self._entries.get
        touch = self._entries.move_to_end
        out = np.zeros(n_slots, dtype=np.int64)
        alive = self._all
        last_drop = 0
        i = 0
        if alive:
            for h in hashes:
                e = get(h)
                if e is None:
                    break
                kept = alive & e[0]
                if kept != alive:
                    if i:  # slots that drop at block 0 hold nothing: out is already 0 there
                        _scatter(out, alive ^ kept, i, n_slots)
                        last_drop = i
                    alive = kept
                    if not alive:
                        break
                i += 1
        for k in range(i - 1, -1, -1):  # last-to-first, as `_walk`
            touch(hashes[k])
        if alive and i:
            _scatter(out, alive, i, n_slots)
        self._count_hit(i if alive else last_drop)
        return out

    def slot_of(self, replica_id: str) -> int:
        """The replica's bit position (column in `match_arrays`); stable until it is removed."""
        return self._require(replica_id)

    def _walk(self, hashes: Sequence[int]) -> tuple[int, list[tuple[int, int, int]]]:
        """The one pass: returns (blocks walked, [(tier, position, slots that dropped there)])."""
        self._begin_lookup(hashes)
        get = self._entries.get
        touch = self._entries.move_to_end
        widen = self._widen
        a_h = a_o = a_s = self._all
        drops: list[tuple[int, int, int]] = []
        i = 0
        n = len(hashes)
        while i < n and a_s:
            h = hashes[i]
            e = get(h)
            if e is None:
                break
            hb, hn, sh = e
            if hn:
                hm = widen.get(hn)
                if hm is None:
                    hm = self._widen_nodes(hn)
                hb_or_host = hb | hm
            else:
                hb_or_host = hb
            n_h = a_h & hb
            if n_h != a_h:
                drops.append((0, i, a_h ^ n_h))
                a_h = n_h
            n_o = a_o & hb_or_host
            if n_o != a_o:
                drops.append((1, i, a_o ^ n_o))
                a_o = n_o
            n_s = a_s if sh else a_s & hb_or_host
            if n_s != a_s:
                drops.append((2, i, a_s ^ n_s))
                a_s = n_s
            if a_s:
                i += 1
        for k in range(i - 1, -1, -1):  # last-to-first: the chain's head is the most recently used
            touch(hashes[k])
        self._count_hit(i if a_s else max((p for t, p, _ in drops if t == 2), default=0))
        return i, drops

    def _begin_lookup(self, hashes: Sequence[int]) -> None:
        """What every lookup does first: drop expired speculation, count the lookup and its blocks."""
        if self._spec_queue:
            self.expire()
        c = self._c
        c["lookups"] += 1
        c["lookup_blocks"] += len(hashes)

    def _count_hit(self, blocks: int) -> None:
        """Count a lookup's longest cached prefix (any tier), when it found one."""
        if blocks:
            self._c["hits"] += 1
            self._c["hit_blocks"] += blocks

    def expire(self) -> int:
        """Drop speculative entries whose TTL passed without confirmation; returns how many."""
        q = self._spec_queue
        if not q:
            return 0
        now = self._clock()
        dropped = 0
        while q and q[0][0] <= now:
            expiry, slot, hashes = q.popleft()
            spec = self._spec.get(slot)
            if spec is None:
                continue  # replica removed
            bit = 1 << slot
            held = self._held[slot]
            for h in hashes:
                entry = spec.get(h)
                if entry is None or entry[0] != expiry:
                    continue  # confirmed, removed or re-speculated later
                del spec[h]
                held.pop(h, None)
                if h in self._entries:
                    self._andnot(h, 0, bit)
                dropped += 1
        self._c["speculative_expired"] += dropped
        return dropped

    @property
    def stats(self) -> dict[str, int]:
        """Counters (monotonic) plus gauges `blocks`, `replicas`, `replicas_stale_now`."""
        return dict(self._c, blocks=len(self._entries), replicas=len(self._slot), replicas_stale_now=len(self._stale))

    def __len__(self) -> int:
        return len(self._entries)

    # ---------------------------------------------------------------- internals
    def _new_mark(self) -> tuple[int, int]:
        """A new speculative mark's (number, claims so far)."""
        self._marks += 1
        return self._marks, 0

    def _ensure_node(self, node_id: str) -> int:
        nslot = self._node_slot.get(node_id)
        if nslot is None:
            nslot = self._node_slots.take()
            self._node_slot[node_id] = nslot
            self._node_name[nslot] = node_id
            self._node_members[nslot] = 0
            self._node_held[nslot] = {}
        return nslot

    def _offload_node(self, replica_id: str) -> int:
        """The node slot of the replica's own offload tier: a node whose only member is that replica."""
        own = self._own_node.get(replica_id)
        if own is None:
            slot = self._require(replica_id)
            own = self._ensure_node(f"offload:{replica_id}")
            self._node_members[own] = 1 << slot
            self._own_node[replica_id] = own
            self._widen.clear()
        return own

    def _node_of(self, replica_id: str) -> str:
        return self._node_name[self._replica_node[replica_id]]

    def _require(self, replica_id: str) -> int:
        slot = self._slot.get(replica_id)
        if slot is None:
            raise KeyError(f"unknown replica {replica_id!r}; call add_replica first")
        return slot

    def _require_rid(self, replica_id: str) -> str:
        self._require(replica_id)
        return replica_id

    def _widen_nodes(self, node_mask: int) -> int:
        mask = 0
        for ns in _bits(node_mask):
            mask |= self._node_members.get(ns, 0)
        self._widen[node_mask] = mask
        return mask

    def _or(self, h: int, field: int, bit: int) -> bool:
        """Set `bit` in field 0/1/2 of h's entry (admitting h if new, touching it in the LRU order).
        Returns whether the bit was already set. The caller evicts (`_trim`) once its whole chain is
        written: evicting after each admission could take the chain's own head, not touched yet
        (written last-to-first), with the other replicas' and tiers' residency of it. Entries are
        replaced, never mutated: tuples of ints are not tracked by the garbage collector, lists are --
        with a million lists a full collection took ~260 ms here, a pause the router must not have."""
        entries = self._entries
        e = entries.get(h)
        if e is None:
            entries[h] = (bit, 0, 0) if field == 0 else (0, bit, 0) if field == 1 else (0, 0, bit)
            self._c["admissions"] += 1
            return False
        entries.move_to_end(h)
        if e[field] & bit:
            return True
        entries[h] = (
            (e[0] | bit, e[1], e[2])
            if field == 0
            else (e[0], e[1] | bit, e[2])
            if field == 1
            else (e[0], e[1], e[2] | bit)
        )
        return False

    def _andnot(self, h: int, field: int, bit: int) -> None:
        """Clear `bit` in field 0/1/2 of h's (existing) entry; drop the entry when nothing is left."""
        e = self._entries[h]
        e = (
            (e[0] & ~bit, e[1], e[2])
            if field == 0
            else (e[0], e[1] & ~bit, e[2])
            if field == 1
            else (e[0], e[1], e[2] & ~bit)
        )
        if e[0] or e[1] or e[2]:
            self._entries[h] = e
        else:
            del self._entries[h]

    def _trim(self) -> None:
        """Evict from the LRU front down to `max_blocks` entries; called once a whole chain is written."""
        entries = self._entries
        while len(entries) > self.max_blocks:
            self._evict_one()

    def _evict_one(self) -> None:
        h, (hb, hn, _) = self._entries.popitem(last=False)
        for s in _bits(hb):
            self._held[s].pop(h, None)
            self._spec[s].pop(h, None)
        for ns in _bits(hn):
            self._node_held[ns].pop(h, None)
        self._c["evictions"] += 1

    def _store_hbm(self, slot: int, hashes: Iterable[int]) -> None:
        """`_or(h, 0, bit)` per hash, written out: the simulator stores every computed block here."""
        bit = 1 << slot
        held = self._held[slot]
        spec = self._spec[slot]
        entries = self._entries
        get = entries.get
        touch = entries.move_to_end
        c = self._c
        for h in _last_first(hashes):  # the chain's head touched last: evicted after its tail (module doc)
            e = get(h)
            if e is None:
                entries[h] = (bit, 0, 0)
                c["admissions"] += 1
            else:
                touch(h)
                hb = e[0]
                if not hb & bit:
                    entries[h] = (hb | bit, e[1], e[2])
            held[h] = None
            if spec and spec.pop(h, None) is not None:
                c["speculative_confirmed"] += 1
        if len(entries) > self.max_blocks:  # once, after the whole chain: see `_or`
            self._trim()

    def _remove_hbm(self, slot: int, hashes: Iterable[int]) -> None:
        """`_andnot(h, 0, bit)` per held hash, written out (every simulated eviction comes here)."""
        bit = 1 << slot
        held = self._held[slot]
        spec = self._spec[slot]
        entries = self._entries
        get = entries.get
        for h in hashes:
            held.pop(h, None)
            if spec:
                spec.pop(h, None)
            e = get(h)
            if e is not None:
                hb = e[0] & ~bit
                if hb or e[1] or e[2]:
                    entries[h] = (hb, e[1], e[2])
                else:
                    del entries[h]

    def _clear_slot(self, slot: int) -> None:
        held = self._held[slot]
        self._remove_hbm(slot, list(held))
        held.clear()
        self._spec[slot].clear()

    def _store_node(self, nslot: int, hashes: Iterable[int]) -> None:
        self._tiered = True
        bit = 1 << nslot
        held = self._node_held[nslot]
        for h in _last_first(hashes):
            self._or(h, 1, bit)
            held[h] = None
        self._trim()

    def _remove_node(self, nslot: int, hashes: Iterable[int]) -> None:
        bit = 1 << nslot
        held = self._node_held[nslot]
        entries = self._entries
        for h in hashes:
            held.pop(h, None)
            if h in entries:
                self._andnot(h, 1, bit)
