"""The prefix tree of a workload's prompts, with unbranching chains merged: the model both placement proofs
(`exact_placement`, `tier_reach`) are written on."""

from __future__ import annotations

from collections.abc import Sequence


def merged_chains(paths: Sequence[Sequence], block_size: int) -> tuple[list[int], list[int], dict]:
    """(tokens per node, parent node per node (-1: none), the node each block belongs to) for `paths`, each a
    prompt's block ids in order (every id names its whole prefix, as vLLM's chained hashes do). A block
    joins its parent's node when it is the parent's only child and no path ends at the parent: every path
    through the node's first block then follows the whole node."""
    parent: dict = {}
    children: dict = {}
    ends: set = set()
    for path in paths:
        above = None
        for h in path:
            if h not in parent:
                parent[h] = above
                children.setdefault(above, set()).add(h)
            above = h
        if above is not None:
            ends.add(above)
    head: dict = {}
    weight: list[int] = []
    up: list[int] = []
    stack = [(h, -1) for h in children.get(None, ())]
    while stack:  # top-down
        h, above_node = stack.pop()
        p = parent[h]
        if p is not None and len(children.get(p, ())) == 1 and p not in ends:
            node = head[p]
        else:
            node = len(weight)
            weight.append(0)
            up.append(above_node)
        head[h] = node
        weight[node] += block_size
        stack.extend((c, node) for c in children.get(h, ()))
    return weight, up, head
