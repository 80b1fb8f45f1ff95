"""An approximate prefix tree whose insertions can be taken back: the live router commits to its first
choice at ranking time and withdraws it when Serve sends the request elsewhere, while the peers it models
(SGLang's cache-aware router, Ray Serve's prefix-aware router) insert only for the replica that took it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.policies.approx_tree import ApproxTree
from kvmesh.policies.base import RequestInfo

# a RoutedTree entry packs (serial of the commit that inserted it, live references, tokens) into one int:
# ints shared by every entry would cost nothing, a tuple per block several times what the tree holds
_TOKEN_BITS = 24
_REF_BITS = 24
_TOKENS = (1 << _TOKEN_BITS) - 1
_ONE_REF = 1 << _TOKEN_BITS
_REFS = ((1 << _REF_BITS) - 1) << _TOKEN_BITS  # saturated: pinned (more references than can be taken back)
_BORN = _TOKEN_BITS + _REF_BITS


class RoutedTree(ApproxTree):
    """An approximate tree whose insertions the router can take back (`withdraw`): the live router commits
    to its first choice at ranking time and withdraws it when Serve places the request elsewhere or ranks
    it again, and the peers insert only for the replica that took the request. A withdrawal removes only
    the blocks no other commit still references: each block counts the commits that referenced it since it
    was inserted, and a commit does not count for a block inserted again after it. Blocks a withdrawn commit
    only touched keep their place in the LRU, and what its insertion trimmed stays trimmed. The last
    `memory` commits can be withdrawn; older ones stay for good, as a commit never withdrawn does."""

    def __init__(self, max_tokens: int | None, target_tokens: int | None = None, memory: int = 16_384):
        super().__init__(max_tokens, target_tokens)
        self.memory = memory
        self._serial = 0
        # (request id, or the request's id() without one; replica) -> (the request without an id, else None;
        # the commit's serial). Keyed by id, not by the object, so prompts' hashes are not kept alive.
        self._commits: OrderedDict[tuple, tuple] = OrderedDict()

    def insert(self, replica_id: str, hashes: Sequence[int], tokens_per_block: int) -> None:
        self._add(replica_id, hashes, tokens_per_block)

    def commit(self, request: RequestInfo, replica_id: str) -> None:
        """`insert` the request's blocks for `replica_id`, so that `withdraw` can take them back."""
        serial = self._add(replica_id, request.block_hashes, request.block_size)
        key = (request.request_id or id(request), replica_id)
        self._commits[key] = (None if request.request_id else request, serial)
        self._commits.move_to_end(key)
        if len(self._commits) > self.memory:
            self._commits.popitem(last=False)

    def withdraw(self, request: RequestInfo, replica_id: str) -> None:
        """Undo `commit(request, replica_id)`: remove the blocks it inserted that no other commit since
        references. Nothing for a commit not remembered (never made, withdrawn already, or too old)."""
        key = (request.request_id or id(request), replica_id)
        seen = self._commits.get(key)
        if seen is None or (seen[0] is not None and seen[0] is not request):
            return
        del self._commits[key]
        serial = seen[1]
        lru = self._lru.get(replica_id)
        if not lru:
            return
        size = self._size.get(replica_id, 0)
        for h in request.block_hashes:
            v = lru.get(h)
            # gone, inserted again after this commit (its reference went with the earlier entry), or pinned
            if v is None or v >> _BORN > serial or v & _REFS == _REFS:
                continue
            v -= _ONE_REF
            if v & _REFS:
                lru[h] = v
                continue
            del lru[h]
            size -= v & _TOKENS
            self._disown(h, replica_id)
        self._size[replica_id] = size

    def _add(self, replica_id: str, hashes: Sequence[int], tokens_per_block: int) -> int:
        """`ApproxTree.insert`, counting one reference on every block; returns the commit's serial."""
        if not 0 <= tokens_per_block <= _TOKENS:
            raise ValueError(f"approximate tree: tokens per block must be within 0..{_TOKENS}")
        self._serial += 1
        serial = self._serial
        fresh = (serial << _BORN) | _ONE_REF | tokens_per_block
        lru = self._lru.setdefault(replica_id, OrderedDict())
        size = self._size.get(replica_id, 0)
        owners = self._owners
        for h in reversed(hashes):
            v = lru.get(h)
            if v is not None:
                if v & _REFS != _REFS:
                    lru[h] = v + _ONE_REF
                lru.move_to_end(h)
            else:
                lru[h] = fresh
                size += tokens_per_block
                owners.setdefault(h, set()).add(replica_id)
        if self.max_tokens is not None and size > self.max_tokens:
            size = self._trim(replica_id, lru, size)
        self._size[replica_id] = size
        return serial

    @staticmethod
    def _tokens(value: int) -> int:
        return value & _TOKENS

    def remove_replica(self, replica_id: str) -> None:
        super().remove_replica(replica_id)
        for key in [k for k in self._commits if k[1] == replica_id]:
            del self._commits[key]
