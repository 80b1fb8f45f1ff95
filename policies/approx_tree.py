"""A router-side guess of each replica's cache, built only from where requests were sent.

SGLang's router and Ray Serve's PrefixCacheAffinityRouter both keep such an "approximate tree"
(a radix tree of request text per worker, fed at routing time, trimmed by LRU) instead of listening
to the engines. Over block hashes that chain their parents, a per-replica set of block hashes *is*
that tree: a hash is present only if its whole prefix was inserted. The peers' policies use this
structure, never the real prefix index, so their misses from stale guesses show up in comparisons.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class ApproxTree:
    """Per replica: an LRU of block hashes (with their token counts). A replica's tree over `max_tokens` is
    trimmed, least recently used first, to `target_tokens` (default `max_tokens`); `max_tokens=None` never
    trims. Why a target below the threshold: Ray Serve's eviction loop cuts a tenant over its threshold down
    to a lower target, not to just under the threshold."""

    def __init__(self, max_tokens: int | None, target_tokens: int | None = None):
        if max_tokens is not None and max_tokens <= 0:
            raise ValueError("approximate tree: max_tokens must be positive")
        if target_tokens is not None and (max_tokens is None or not 0 <= target_tokens <= max_tokens):
            raise ValueError("approximate tree: target_tokens must be within 0..max_tokens")
        self.max_tokens = max_tokens
        self.target_tokens = (max_tokens or 0) if target_tokens is None else target_tokens  # unused when unbounded
        self._owners: dict[int, set[str]] = {}  # hash -> replicas whose tree holds it
        self._lru: dict[str, OrderedDict[int, int]] = {}
        self._size: dict[str, int] = {}

    def size(self, replica_id: str) -> int:
        """Tokens held in `replica_id`'s tree (the 'tree size' both peers balance on)."""
        return self._size.get(replica_id, 0)

    def match(self, hashes: Sequence[int], replica_ids: Sequence[str]) -> dict[str, int]:
        """Longest prefix (in blocks) of `hashes` present in each replica's tree."""
        out = dict.fromkeys(replica_ids, 0)
        alive = set(replica_ids)
        owners = self._owners
        for i, h in enumerate(hashes):
            holders = owners.get(h)
            if not holders:
                break
            nxt = alive & holders
            for rid in alive - nxt:
                out[rid] = i
            alive = nxt
            if not alive:
                break
        else:
            i = len(hashes)
            for rid in alive:
                out[rid] = i
            return out
        for rid in alive:
            out[rid] = i
        return out

    def insert(self, replica_id: str, hashes: Sequence[int], tokens_per_block: int) -> None:
        """Record that the request with these blocks was sent to `replica_id` (children evict first)."""
        lru = self._lru.setdefault(replica_id, OrderedDict())
        size = self._size.get(replica_id, 0)
        owners = self._owners
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = tokens_per_block
                size += tokens_per_block
                owners.setdefault(h, set()).add(replica_id)
        if self.max_tokens is not None and size > self.max_tokens:
            size = self._trim(replica_id, lru, size)
        self._size[replica_id] = size

    def _trim(self, replica_id: str, lru: OrderedDict[int, int], size: int) -> int:
        """Evict `replica_id`'s least recently used blocks until its tree holds at most `target_tokens`."""
        while size > self.target_tokens and lru:
            h, v = lru.popitem(last=False)
            size -= self._tokens(v)
            self._disown(h, replica_id)
        return size

    @staticmethod
    def _tokens(value: int) -> int:
        """The tokens a block's LRU entry stands for (the entry itself here; subclasses pack more into it)."""
        return value

    def _disown(self, h: int, replica_id: str) -> None:
        """`replica_id`'s tree no longer holds block `h`: off its owners."""
        s = self._owners.get(h)
        if s is not None:
            s.discard(replica_id)
            if not s:
                del self._owners[h]

    def remove_replica(self, replica_id: str) -> None:
        for h in self._lru.pop(replica_id, {}):
            self._disown(h, replica_id)
        self._size.pop(replica_id, None)
