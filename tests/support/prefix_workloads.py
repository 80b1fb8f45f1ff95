"""Small random workloads for checking placement bounds against every placement (unit tests)."""

from __future__ import annotations

import random

from kvmesh.cluster.trace import TraceRequest


def branching_requests(rng: random.Random, n: int, block_size: int, aligned: bool = True) -> list[TraceRequest]:
    """`n` prompts that branch off each other's prefixes, each block id naming its whole prefix (as the
    prefix index assumes); with `aligned`, some end on a block boundary."""
    paths: list[list[int]] = []
    next_id = 1
    out = []
    for _ in range(n):
        base = rng.choice(paths)[: rng.randint(0, 4)] if paths and rng.random() < 0.8 else []
        ids = base + list(range(next_id, next_id + rng.randint(1, 3)))
        next_id += len(ids)
        paths.append(ids)
        tokens = (len(ids) - 1) * block_size + rng.randint(1, block_size if aligned else block_size - 1)
        out.append(TraceRequest(float(len(out)), tokens, 1, ids))
    return out
