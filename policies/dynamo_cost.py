"""NVIDIA Dynamo's KV router cost function, re-implemented for comparison.

Sources: ai-dynamo/dynamo docs/router/README.md ("Cost Function": logit = kv_overlap_score_weight x
potential_prefill_blocks + potential_active_blocks, lower is better, temperature 0 = argmin) and
lib/kv-router/src/scheduling/selector.rs (DefaultWorkerSelector: potential_prefill_blocks =
(prefill tokens already queued on the worker + this request's new tokens) / block_size, new tokens
= isl - overlap_blocks x block_size; decode term = the worker's active blocks plus this request's
new blocks). Default overlap weight 1.0, temperature 0. Overlap comes from the KV-event index (the
hbm tier). Active blocks: `extra["active_blocks"]` when the caller provides it, else
kv_usage x capacity_blocks. Ties are broken randomly (seeded).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvmesh.policies.base import Policy, ReplicaView, RequestInfo


class DynamoCost(Policy):
    name = "dynamo_cost"
    uses_index = True

    def __init__(self, seed: int = 0, overlap_score_weight: float = 1.0, **params):
        super().__init__(seed, overlap_score_weight=overlap_score_weight, **params)
        self.overlap_score_weight = overlap_score_weight

    def rank(self, request: RequestInfo, replicas: Sequence[ReplicaView]) -> list[str]:
        rng = self.draws(request)
        if not replicas:
            return []
        bs = request.block_size
        isl = request.num_tokens
        req_blocks = math.ceil(isl / bs)
        logit = {}
        for v in replicas:
            overlap = min(v.hbm_blocks, req_blocks)
            new_tokens = max(isl - overlap * bs, 0)
            prefill_blocks = (v.pending_prefill_tokens + new_tokens) / bs
            active = v.extra.get("active_blocks")
            if active is None:
                active = v.kv_usage * v.capacity_blocks
            logit[v.replica_id] = self.overlap_score_weight * prefill_blocks + active + (req_blocks - overlap)
        ids = list(logit)
        rng.shuffle(ids)
        return sorted(ids, key=lambda r: logit[r])
