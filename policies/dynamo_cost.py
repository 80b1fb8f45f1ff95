"""NVIDIA Dynamo's KV router cost function, re-implemented for comparison.

Sources (ai-dynamo/dynamo): docs/router/README.md ("Cost Function": logit = kv_overlap_score_weight x
potential_prefill_blocks + potential_active_blocks, lower is better, temperature 0 = argmin) and the router
design doc (docs.nvidia.com/dynamo/v1.2.0 "Router Design": potential active blocks = the worker's active blocks
+ the incoming request's new blocks); lib/kv-router/src/scheduling/selector/default.rs and selector/mod.rs
(`worker_logit`: prefill_load_scale x max(0, (queued prefill tokens + isl) / block - credit x overlap blocks)
+ potential decode blocks, the latter = active blocks + the request's full blocks not already active,
`WorkerLoadProjection::potential_decode_blocks`); lib/kv-router/src/scheduling/config.rs `KvRouterConfig::default`
(read at commit 0243c51): overlap credit 1.0, prefill_load_scale 1.0, overlap_score_credit_decay 0,
decode_active_request_weight 0, temperature 0, router_track_active_blocks and router_assume_kv_reuse true (a
prompt block that several in-flight requests share is booked once), router_track_output_blocks false (output
blocks are not booked). Active blocks are the router's own booking: a request's prompt blocks from routing to
its end, not the engine's KV usage.
Taken: overlap from the KV-event index (the hbm tier); active blocks from `extra["active_prompt_blocks"]` (hash ->
in-flight requests holding it; the simulator gives it), else `extra["active_blocks"]` or kv_usage x
capacity_blocks with all of the request's blocks new. Ties are broken randomly (seeded).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvmesh.policies.base import Policy, ReplicaView, RequestInfo
from kvmesh.policies.cost_model import MAX_WEIGHT, check_param


def potential_active_blocks(v: ReplicaView, request: RequestInfo) -> float:
    """The worker's active blocks plus the request's full blocks not already active there."""
    booked = v.extra.get("active_prompt_blocks")
    if booked is not None:
        return len(booked) + sum(1 for h in request.block_hashes if h not in booked)
    active = v.extra.get("active_blocks")
    if active is None:
        active = v.kv_usage * v.capacity_blocks
    return active + len(request.block_hashes)


class DynamoCost(Policy):
    name = "dynamo_cost"
    uses_index = True
    load_signals = ("active_prompt_blocks",)  # the router's booking, where the caller keeps it

    def __init__(self, seed: int = 0, overlap_score_weight: float = 1.0, **params):
        super().__init__(seed, overlap_score_weight=overlap_score_weight, **params)
        check_param(self.name, "overlap_score_weight", overlap_score_weight, high=MAX_WEIGHT)
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
            logit[v.replica_id] = self.overlap_score_weight * prefill_blocks + potential_active_blocks(v, request)
        ids = list(logit)
        rng.shuffle(ids)
        return sorted(ids, key=lambda r: logit[r])
