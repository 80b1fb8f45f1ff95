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

from collections import OrderedDict
from typing import Sequence

import numpy as np

from policies.base import FleetView, Policy, ReplicaView, RequestInfo
from policies.cost_model import DEFAULT_COST_MODEL, CostModel


class KvmeshPolicy(Policy):
    name = "kvmesh"
    uses_index = True

    def __init__(self, seed: int = 0, cost: CostModel | dict | None = None, balance_slack: float = 0.10,
                 window_tokens_per_replica: int = 20_000_000, mean_output_tokens: int = 256,
                 recompute_weight: float = 30.0, **params):
        super().__init__(seed, balance_slack=balance_slack, window_tokens_per_replica=window_tokens_per_replica,
                         mean_output_tokens=mean_output_tokens, recompute_weight=recompute_weight, **params)
        if balance_slack < 0 or recompute_weight < 0:
            raise ValueError("kvmesh: balance_slack and recompute_weight must be >= 0")
        self.cost = cost if isinstance(cost, CostModel) else CostModel.from_dict(cost) if cost else DEFAULT_COST_MODEL
        self.balance_slack = balance_slack
        self.window_tokens_per_replica = window_tokens_per_replica
        self.mean_output_tokens = mean_output_tokens
        self.recompute_weight = recompute_weight
        # recent predicted prefill work per replica, in one growing array (slot per replica id)
        self._slot: dict[str, int] = {}
        self._w = np.zeros(0)
        self._total = 0.0
        self._ids_key: tuple = ()
        self._ids_idx = np.zeros(0, dtype=np.int64)
        self._ids_pos: dict[str, int] = {}
        self._last: tuple | None = None  # (request, ids, ttft array, uncached array)
        # decisions awaiting on_routed, by id(request): a live router may rank several requests
        # (concurrently, retries) before it reports where each went
        self._awaiting: OrderedDict[int, tuple] = OrderedDict()

    # ------------------------------------------------------------------ scoring
    def _positions(self, ids: Sequence[str]) -> np.ndarray:
        """Slots of `ids` in the work array (new replicas start at the current mean)."""
        key = tuple(ids)
        if key != self._ids_key:
            live = len(self._slot)
            mean = self._total / live if live else 0.0
            for rid in key:
                if rid not in self._slot:
                    self._slot[rid] = len(self._w)
                    self._w = np.append(self._w, mean)
                    self._total += mean
            self._ids_key = key
            self._ids_idx = np.fromiter((self._slot[r] for r in key), dtype=np.int64, count=len(key))
            self._ids_pos = {r: k for k, r in enumerate(key)}
        return self._ids_idx

    def _predict(self, request: RequestInfo, hbm_b, host_b, shared_b, queued, running, pending):
        """Arrays (predicted TTFT in s, prompt tokens that would be computed) per replica. Pure."""
        c = self.cost
        n, bs = request.num_tokens, request.block_size
        most = max(0, (n - 1) // bs)  # vLLM: whole blocks only, last token always computed
        hbm = np.minimum(hbm_b, most) * bs
        host = np.minimum(host_b, most) * bs
        shared = np.minimum(shared_b, most) * bs
        wait = pending * c.prefill_s_per_token + queued * c.prefill_base_s
        over = queued + running + (1 - c.max_batch)
        wait = wait + np.maximum(over, 0) * (self.mean_output_tokens * c.decode_s_per_token / c.max_batch)
        uncached = n - shared
        ttft = (wait + c.prefill_base_s + uncached * c.prefill_s_per_token
                + (shared - host) * c.shared_load_s_per_token + (host - hbm) * c.host_load_s_per_token)
        return ttft, uncached

    def _keys(self, request: RequestInfo, ids, hbm_b, host_b, shared_b, queued, running, pending):
        """Sort keys per replica, most significant first: (outside the balance guard, score, recent work)."""
        ttft, uncached = self._predict(request, hbm_b, host_b, shared_b, queued, running, pending)
        score = np.round(ttft + self.recompute_weight * self.cost.prefill_s_per_token * uncached, 9)
        idx = self._positions(ids)  # may grow self._w: index it afterwards
        work = self._w[idx]
        limit = (1.0 + self.balance_slack) * (self._total / len(self._slot)) + request.num_tokens
        self._last = (request, ids, ttft, uncached)
        self._awaiting[id(request)] = self._last
        if len(self._awaiting) > 256:
            self._awaiting.popitem(last=False)
        if self._total > self.window_tokens_per_replica * len(self._slot):
            self._w *= 0.5
            self._total *= 0.5
        return work > limit, score, work

    def _order(self, request: RequestInfo, ids, *arrays) -> np.ndarray:
        """Indices into `ids`, best first (ties: lower index)."""
        over, score, work = self._keys(request, ids, *arrays)
        return np.lexsort((np.arange(len(ids)), work, score, over))

    def _best(self, request: RequestInfo, ids, *arrays) -> int:
        """`_order(...)[0]` without sorting everything (the simulator's hot path)."""
        over, score, work = self._keys(request, ids, *arrays)
        if over.any() and not over.all():
            score = np.where(over, np.inf, score)
        cand = np.flatnonzero(score == score.min())
        if len(cand) > 1:
            w = work[cand]
            cand = cand[w == w.min()]
        return int(cand[0])

    def predict(self, request: RequestInfo, v: ReplicaView) -> tuple[float, int]:
        """(predicted TTFT in seconds, prompt tokens that would be computed) for `request` on `v`."""
        ttft, unc = self._predict(request, *(np.array([x]) for x in (
            v.hbm_blocks, v.host_blocks, v.shared_blocks, v.queued, v.running, v.pending_prefill_tokens)))
        return float(ttft[0]), int(unc[0])

    def rank(self, request: RequestInfo, replicas: Sequence[ReplicaView]) -> list[str]:
        if not replicas:
            return []
        ids = [v.replica_id for v in replicas]
        arr = [np.fromiter((getattr(v, f) for v in replicas), dtype=np.int64, count=len(replicas)) for f in
               ("hbm_blocks", "host_blocks", "shared_blocks", "queued", "running", "pending_prefill_tokens")]
        return [ids[k] for k in self._order(request, ids, *arr)]

    def choose(self, request: RequestInfo, fleet: FleetView) -> int:
        return self._best(request, fleet.ids, fleet.hbm_blocks, fleet.host_blocks, fleet.shared_blocks,
                          fleet.queued, fleet.running, fleet.pending_prefill_tokens)

    @property
    def last_prediction(self) -> dict[str, float]:
        """Predicted TTFT (s) per replica for the last ranked request (for explanations)."""
        if self._last is None:
            return {}
        _, ids, ttft, _ = self._last
        return {rid: float(t) for rid, t in zip(ids, ttft)}

    # ------------------------------------------------------------------ feedback
    def on_routed(self, request: RequestInfo, replica_id: str) -> None:
        """Credit the replica with the prefill work predicted for it when `request` was ranked."""
        seen = self._awaiting.pop(id(request), None)
        u = request.num_tokens  # routed without a ranking (e.g. a fallback): count the whole prompt
        if seen is not None and seen[0] is request:
            ids = seen[1]
            pos = self._ids_pos.get(replica_id) if ids is self._ids_key or tuple(ids) == self._ids_key else None
            if pos is None and replica_id in ids:
                pos = list(ids).index(replica_id)
            if pos is not None:
                u = float(seen[3][pos])
        if replica_id not in self._slot:
            self._positions(list(self._ids_key) + [replica_id])
        self._w[self._slot[replica_id]] += u
        self._total += u

    def on_replica_removed(self, replica_id: str) -> None:
        slot = self._slot.pop(replica_id, None)
        if slot is None:
            return
        self._total -= self._w[slot]
        self._w[slot] = 0.0
        self._ids_key = ()  # rebuild positions on the next call

    def recent_work(self) -> dict[str, float]:
        return {rid: float(self._w[s]) for rid, s in self._slot.items()}
