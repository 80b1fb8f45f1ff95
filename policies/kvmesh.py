"""kvmesh's placement: the replica with the lowest predicted time to first token, inside a balance guard.

Predicted TTFT on replica r (all terms from `policies.cost_model.CostModel`, the simulator's model):

    wait_r    = pending_prefill_tokens_r * prefill_s_per_token + queued_r * prefill_base_s
                (+ a slot wait when queued + running already fill max_batch)
    prefill_r = prefill_base_s + (n - shared_r) * prefill_s_per_token
                + (shared_r - host_r) * shared_load_s_per_token + (host_r - hbm_r) * host_load_s_per_token

where hbm_r <= host_r <= shared_r are the request's cached prompt tokens per tier on r (from the
prefix index). Tier credits fall out of the formula: a token in host DRAM costs 1/20 of recomputing
it, in the shared tier 1/4, so a replica on the node holding a spilled prefix beats a cold one.

Why the guard: minimising each request's own TTFT is greedy. When queues are empty (low load) every
replica predicts the same wait, and affinity alone would keep growing the replicas that happen to
own popular prefixes; a hot system prompt would pull every new conversation onto one replica. The
guard tracks the prefill work this policy has sent to each replica (tokens it predicted would be
computed, halved whenever the fleet total passes `window_tokens_per_replica * N`, so it follows the
recent mix and a new replica starts at the mean). A replica whose recent work exceeds
`(1 + balance_slack) * mean + num_tokens` is ranked after every replica within that bound. Ties (for
example all replicas hold only the shared system prompt) go to the replica with the least recent
work, which is what spreads a shared prompt over the fleet.

The same object runs in the live router (deployments/) and in the simulator (cluster/simulator.py).
"""
from __future__ import annotations

from typing import Sequence

from policies.base import Policy, ReplicaView, RequestInfo
from policies.cost_model import DEFAULT_COST_MODEL, CostModel, cached_tokens


class KvmeshPolicy(Policy):
    name = "kvmesh"
    uses_index = True

    def __init__(self, seed: int = 0, cost: CostModel | dict | None = None, balance_slack: float = 0.10,
                 window_tokens_per_replica: int = 20_000_000, mean_output_tokens: int = 256,
                 recompute_weight: float = 30.0, **params):
        super().__init__(seed, balance_slack=balance_slack, window_tokens_per_replica=window_tokens_per_replica,
                         mean_output_tokens=mean_output_tokens, recompute_weight=recompute_weight, **params)
        if balance_slack < 0:
            raise ValueError("kvmesh: balance_slack must be >= 0")
        self.cost = cost if isinstance(cost, CostModel) else CostModel.from_dict(cost) if cost else DEFAULT_COST_MODEL
        self.balance_slack = balance_slack
        self.window_tokens_per_replica = window_tokens_per_replica
        self.mean_output_tokens = mean_output_tokens
        self.recompute_weight = recompute_weight
        self._work: dict[str, float] = {}  # replica -> recent predicted prefill tokens sent there
        self._total = 0.0
        self._pending: tuple[object, dict[str, int]] | None = None  # last ranked request -> uncached tokens
        self.last_prediction: dict[str, float] = {}  # replica -> predicted TTFT (s), for explanations

    # ------------------------------------------------------------------ scoring
    def predict(self, request: RequestInfo, v: ReplicaView) -> tuple[float, int]:
        """(predicted TTFT in seconds, prompt tokens that would be computed) for `request` on `v`."""
        c = self.cost
        n, bs = request.num_tokens, request.block_size
        hbm = cached_tokens(v.hbm_blocks, n, bs)
        host = cached_tokens(v.host_blocks, n, bs)
        shared = cached_tokens(v.shared_blocks, n, bs)
        wait = v.pending_prefill_tokens * c.prefill_s_per_token + v.queued * c.prefill_base_s
        over = v.queued + v.running + 1 - c.max_batch
        if over > 0:  # no free sequence slot: wait for `over` decodes to finish (mean length assumed)
            wait += over * self.mean_output_tokens * c.decode_s_per_token / c.max_batch
        return wait + c.prefill_s(n, hbm, host, shared), n - shared

    def rank(self, request: RequestInfo, replicas: Sequence[ReplicaView]) -> list[str]:
        work = self._work
        n_rep = len(replicas)
        mean = self._total / len(work) if work else 0.0
        for v in replicas:  # a replica seen for the first time starts at the mean (no stampede)
            if v.replica_id not in work:
                work[v.replica_id] = mean
                self._total += mean
        mean = self._total / len(work)
        limit = (1.0 + self.balance_slack) * mean + request.num_tokens
        keyed = []
        uncached = {}
        pred = {}
        for i, v in enumerate(replicas):
            rid = v.replica_id
            ttft, u = self.predict(request, v)
            uncached[rid] = u
            pred[rid] = ttft
            w = work[rid]
            score = ttft + self.recompute_weight * u * self.cost.prefill_s_per_token
            keyed.append((w > limit, round(score, 9), w, i, rid))
        keyed.sort()
        self._pending = (request, uncached)
        self.last_prediction = pred
        if n_rep and self._total > self.window_tokens_per_replica * n_rep:
            self._decay()
        return [k[-1] for k in keyed]

    # ------------------------------------------------------------------ feedback
    def on_routed(self, request: RequestInfo, replica_id: str) -> None:
        pending = self._pending
        if pending is None or pending[0] is not request:
            u = request.num_tokens  # routed without a rank() call (e.g. a fallback): count it all
        else:
            u = pending[1].get(replica_id, request.num_tokens)
        self._work[replica_id] = self._work.get(replica_id, 0.0) + u
        self._total += u
        self._pending = None

    def on_replica_removed(self, replica_id: str) -> None:
        self._total -= self._work.pop(replica_id, 0.0)

    def _decay(self) -> None:
        for rid in self._work:
            self._work[rid] *= 0.5
        self._total *= 0.5

    def recent_work(self) -> dict[str, float]:
        return dict(self._work)
