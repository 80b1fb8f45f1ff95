"""What simulator unit tests share: a cost model with round numbers, and a policy that places each request
where the test says."""

from __future__ import annotations

from kvmesh.policies.cost_model import CostModel

# 10 ms per prompt token, 100 ms per prefill, loads at 1/10 (host) and 1/2 (shared) of recomputing
COST = CostModel(
    prefill_s_per_token=0.01,
    prefill_base_s=0.1,
    decode_s_per_token=0.001,
    host_load_s_per_token=0.001,
    shared_load_s_per_token=0.005,
    max_batch=64,
)


class FixedPlacement:
    """Places request i on replica `order[i]`; holds for a prefix in flight only when `hold`."""

    name = "fixed"
    uses_index = True

    def __init__(self, order, hold: bool):
        self.order, self.hold = order, hold

    def on_replica_added(self, rid):
        pass

    def best(self, request, fleet):
        return self.order[int(request.request_id)]

    def on_routed(self, *a, **k):
        pass

    def hold_worth(self, missing_tokens, extra_wait_s):
        return self.hold
