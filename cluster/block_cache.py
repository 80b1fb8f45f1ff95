"""A finite LRU cache of KV blocks: the simulator's stand-in for one tier on one replica or node, and
the router's model of an LMCache tier's capacity (`tier_tracker`).

Eviction order follows vLLM's block pool: when a request's blocks are touched they are touched last
block first, so the request's first block is the most recently used and a parent always outlives its
children (a prefix is never left with a hole in its middle by LRU alone).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def leading_held(hashes: Sequence[int], held) -> int:
    """How many leading blocks of `hashes` are in `held` (any container: a set, a dict, an LRU's map)."""
    i = 0
    for h in hashes:
        if h not in held:
            break
        i += 1
    return i


class BlockLRU:
    """Block hash -> present, LRU-evicted beyond `capacity` blocks (None = unbounded; 0 = holds nothing,
    as a tier smaller than one block). `capacity` may change; the next `admit` evicts down to it."""

    __slots__ = ("capacity", "_d")

    def __init__(self, capacity: int | None):
        if capacity is not None and capacity < 0:
            raise ValueError("block cache capacity must be >= 0 (or None for unbounded)")
        self.capacity = capacity
        self._d: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, h: int) -> bool:
        return h in self._d

    def prefix_len(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are cached."""
        return leading_held(hashes, self._d)

    def admit(self, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Touch/insert `hashes` (children first); returns (newly inserted, evicted)."""
        d = self._d
        new = []
        move = d.move_to_end
        for h in reversed(hashes):
            if h in d:
                move(h)
            else:
                d[h] = None
                new.append(h)
        evicted = []
        cap = self.capacity
        if cap is not None:
            while len(d) > cap:
                evicted.append(d.popitem(last=False)[0])
        if evicted and new:
            gone = set(evicted)
            new = [h for h in new if h not in gone]
        return new, evicted

    def clear(self) -> list[int]:
        """Forget every block (a restarted or lost tier); returns what was held."""
        gone = list(self._d)
        self._d.clear()
        return gone
