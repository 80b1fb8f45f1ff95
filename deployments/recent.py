"""A bounded set of what was seen lately: the routers' and the miss attribution's memory of ids and blocks.

Why one class: each of them must answer "seen lately?" without growing for good, forgetting the oldest
first; a key seen again counts as seen last."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator


class RecentSet:
    """An insertion-ordered set that forgets its oldest keys beyond `cap`."""

    __slots__ = ("cap", "_d")

    def __init__(self, cap: int):
        self.cap = cap
        self._d: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def add(self, key: Hashable) -> None:
        self.update((key,))

    def update(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self._d[key] = None
            self._d.move_to_end(key)
        while len(self._d) > self.cap:
            self._d.popitem(last=False)
