"""llm-d's inference scheduler with the precise prefix-cache profile, re-implemented for comparison.

Sources: llm-d `guides/precise-prefix-cache-aware` (EndpointPickerConfig: precise-prefix-cache-scorer
weight 3, kv-cache-utilization-scorer weight 2, queue-scorer weight 2, max-score-picker), the
llm-d-inference-scheduler plugin docs (precise scorer reads the llm-d-kv-cache index fed by vLLM KV
events), and the Gateway API Inference Extension scorers (queue: (max-q)/(max-min), all 1 when equal;
kv-cache utilisation: 1 - usage). Taken: the weighted sum of those three scores, each in [0, 1], and
picking the maximum. Prefix score = longest device-cached prefix in blocks, min-max normalised over
the candidates (as the scheduler's score normalisation does). Ties are broken randomly (seeded).
This policy uses the real prefix index (hbm tier), like llm-d's precise mode.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.policies.base import Policy, ReplicaView, RequestInfo
from kvmesh.policies.baselines import outstanding


def _minmax(values: dict[str, float], invert: bool = False) -> dict[str, float]:
    lo, hi = min(values.values()), max(values.values())
    if hi == lo:
        return dict.fromkeys(values, 1.0 if (invert or hi > 0) else 0.0)
    span = hi - lo
    return {k: ((hi - v) if invert else (v - lo)) / span for k, v in values.items()}


class LlmdPrecise(Policy):
    name = "llmd_precise"
    uses_index = True

    def __init__(
        self,
        seed: int = 0,
        prefix_weight: float = 3.0,
        kv_util_weight: float = 2.0,
        queue_weight: float = 2.0,
        **params,
    ):
        super().__init__(
            seed, prefix_weight=prefix_weight, kv_util_weight=kv_util_weight, queue_weight=queue_weight, **params
        )
        self.w = (prefix_weight, kv_util_weight, queue_weight)

    def rank(self, request: RequestInfo, replicas: Sequence[ReplicaView]) -> list[str]:
        rng = self.draws(request)
        if not replicas:
            return []
        prefix = _minmax({v.replica_id: float(v.hbm_blocks) for v in replicas})
        queue = _minmax({v.replica_id: float(outstanding(v)) for v in replicas}, invert=True)
        wp, wk, wq = self.w
        score = {
            v.replica_id: wp * prefix[v.replica_id] + wk * (1.0 - v.kv_usage) + wq * queue[v.replica_id]
            for v in replicas
        }
        ids = list(score)
        rng.shuffle(ids)
        return sorted(ids, key=lambda r: -score[r])
