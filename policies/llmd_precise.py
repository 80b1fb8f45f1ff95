"""llm-d's inference scheduler with the precise prefix-cache profile, re-implemented for comparison.

Sources, read at llm-d/llm-d-router (formerly llm-d-inference-scheduler) commit ebab687 (2026-08-22):
- `deploy/config/epp-precise-prefix-cache-config.yaml`, and llm-d/llm-d
  `guides/precise-prefix-cache-aware/scheduler/precise-prefix-cache-aware.values.yaml` (commit 019a3f3): the
  profile is precise prefix-cache scorer weight 2, kv-cache-utilization-scorer 1, queue-scorer 1, then
  max-score-picker.
- The precise prefix score is the endpoint's matched blocks / the request's blocks, clipped to [0, 1]
  (`absoluteScoredPods`, commit e6f6b84, 2026-05-14, replacing min-max normalisation across
  endpoints; kept by the generic `scheduling/scorer/prefix/plugin.go` fed by `precise-prefix-cache-producer`,
  matchLengthWeight 0). Matched blocks: the longest device-cached prefix in the KV-event index (hbm here).
- `scheduling/scorer/queuedepth/queue.go`: (max - q) / (max - min) over the endpoints' WaitingQueueSize
  (`vllm:num_requests_waiting`), all 1 when equal. `scheduling/scorer/kvcacheutilization/kvcache_utilization.go`:
  1 - KVCacheUsagePercent (`vllm:kv_cache_usage_perc`).
Load inputs: the engine's own figures where the caller gives them (`extra["waiting"]`, `extra["kv_cache_usage"]`,
as the simulator does), else `queued` (requests without a first token, which also counts the one prefilling)
and `kv_usage`. Ties are broken randomly (seeded), as the max-score picker shuffles.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.policies.base import Policy, ReplicaView, RequestInfo
from kvmesh.policies.cost_model import MAX_WEIGHT, check_param


def queue_scores(waiting: dict[str, float]) -> dict[str, float]:
    """The queue scorer: the shortest waiting queue scores 1, the longest 0, all 1 when equal."""
    lo, hi = min(waiting.values()), max(waiting.values())
    if hi == lo:
        return dict.fromkeys(waiting, 1.0)
    return {k: (hi - q) / (hi - lo) for k, q in waiting.items()}


def prefix_score(matched_blocks: int, request_blocks: int) -> float:
    """The precise prefix scorer: matched / total blocks, clipped to [0, 1]; 0 for a request without blocks."""
    if request_blocks <= 0:
        return 0.0
    return min(max(matched_blocks / request_blocks, 0.0), 1.0)


def waiting_requests(v: ReplicaView) -> float:
    """The engine's waiting queue (`vllm:num_requests_waiting`), else requests without a first token."""
    return float(v.extra.get("waiting", v.queued))


def kv_cache_usage(v: ReplicaView) -> float:
    """The engine's allocated KV fraction (`vllm:kv_cache_usage_perc`), else the router's `kv_usage`."""
    return float(v.extra.get("kv_cache_usage", v.kv_usage))


class LlmdPrecise(Policy):
    name = "llmd_precise"
    uses_index = True
    load_signals = ("waiting", "kv_cache_usage")  # the engine's own metrics, where the caller keeps them

    def __init__(
        self,
        seed: int = 0,
        prefix_weight: float = 2.0,
        kv_util_weight: float = 1.0,
        queue_weight: float = 1.0,
        **params,
    ):
        super().__init__(
            seed, prefix_weight=prefix_weight, kv_util_weight=kv_util_weight, queue_weight=queue_weight, **params
        )
        self.w = (prefix_weight, kv_util_weight, queue_weight)
        for name, weight in zip(("prefix_weight", "kv_util_weight", "queue_weight"), self.w):
            check_param(self.name, name, weight, high=MAX_WEIGHT)

    def rank(self, request: RequestInfo, replicas: Sequence[ReplicaView]) -> list[str]:
        rng = self.draws(request)
        if not replicas:
            return []
        total = len(request.block_hashes)
        queue = queue_scores({v.replica_id: waiting_requests(v) for v in replicas})
        wp, wk, wq = self.w
        score = {
            v.replica_id: wp * prefix_score(v.hbm_blocks, total)
            + wk * (1.0 - kv_cache_usage(v))
            + wq * queue[v.replica_id]
            for v in replicas
        }
        ids = list(score)
        rng.shuffle(ids)
        return sorted(ids, key=lambda r: -score[r])
