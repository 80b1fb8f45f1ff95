"""Ingress-side serving metrics in Prometheus text form: hit rates (token-weighted, and the mean over
requests of each one's cached share), the share of requests with any hit,
cached tokens, TTFT, predicted vs delivered cached tokens -- for the fleet, and per engine replica in
families of their own (`kvmesh_replica_*`, so a plain `sum()` of a family is never twice the truth) --
and the time each request spends in the ingress's stages (sum of seconds and count per stage), so the
per-request overhead can be split without a profiler.

Why hand-rolled: a few counters and one histogram per replica; prometheus_client's global registry
would collide across Serve replicas sharing a process in tests, and we want `snapshot()` as plain data
for the demo and tests too.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Forgotten replica ids remembered, oldest dropped first: a request in flight on a replica when the router
# forgot it counts in the totals only, however late it finishes (as in the prediction ledger). Bounded by
# count, not time, so a long stream cannot outlive what is remembered of its replica.
FORGOTTEN_MAX = 4096
# The prefix index's stats that are levels, not counts (cluster/index.py `PrefixIndex.stats`): gauges of
# their own, since a counter that goes down reads as a reset.
INDEX_GAUGES = {
    "blocks": ("kvmesh_router_index_blocks", "blocks the router's prefix index holds"),
    "replicas": ("kvmesh_router_index_replicas", "engine replicas the router's prefix index tracks"),
    "replicas_stale_now": (
        "kvmesh_router_index_stale_replicas",
        "replicas whose KV event stream had a gap, their cache view not rebuilt yet",
    ),
}


@dataclass
class _Counters:
    requests: int = 0
    hit_requests: int = 0  # requests with cached_tokens > 0
    hit_ratio_sum: float = 0.0  # sum over requests of cached / prompt tokens
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS))

    def add(self, prompt: int, cached: int, completion: int, ttft: float | None) -> None:
        self.requests += 1
        self.hit_requests += cached > 0
        self.hit_ratio_sum += cached / prompt if prompt else 0.0
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.completion_tokens += completion
        if ttft is not None:
            self.ttft_sum += ttft
            self.ttft_count += 1
            i = bisect.bisect_left(TTFT_BUCKETS, ttft)
            for j in range(i, len(TTFT_BUCKETS)):
                self.ttft_buckets[j] += 1

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "hit_rate_tokens": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "hit_rate_requests": self.hit_ratio_sum / self.requests if self.requests else 0.0,
            "requests_with_hit": self.hit_requests / self.requests if self.requests else 0.0,
            "ttft_mean_s": self.ttft_sum / self.ttft_count if self.ttft_count else None,
        }


def _per_replica(routing_stats: dict, key: str) -> list[tuple[dict, float]]:
    """(labels, value) per replica that reports `key` in its routing stats; one that does not (an older
    replica) gets no sample rather than a 0."""
    return [({"replica": rid}, s[key]) for rid, s in sorted(routing_stats.items()) if s.get(key) is not None]


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# The serving families written once for the fleet (kvmesh_*) and once per engine replica (kvmesh_replica_*):
# (name after the prefix, type, help, the figure from a replica's or the fleet's counters)
_FAMILIES: tuple[tuple[str, str, str, Callable[[_Counters], float]], ...] = (
    ("requests_total", "counter", "completed generation requests", lambda c: c.requests),
    ("prompt_tokens_total", "counter", "prompt tokens", lambda c: c.prompt_tokens),
    ("cached_prompt_tokens_total", "counter", "prompt tokens served from the KV cache", lambda c: c.cached_tokens),
    ("completion_tokens_total", "counter", "generated tokens", lambda c: c.completion_tokens),
    (
        "hit_rate_tokens",
        "gauge",
        "token-weighted KV hit rate = cached / prompt tokens",
        lambda c: c.as_dict()["hit_rate_tokens"],
    ),
    (
        "hit_rate_requests",
        "gauge",
        "mean over requests of cached / prompt tokens",
        lambda c: c.as_dict()["hit_rate_requests"],
    ),
    (
        "requests_with_hit",
        "gauge",
        "fraction of requests with any cached prompt token",
        lambda c: c.as_dict()["requests_with_hit"],
    ),
)


# The router's own counters: (family, its key in /kvmesh/state's router, help, value before any)
_ROUTER_COUNTERS = (
    ("kvmesh_router_decisions_total", "decisions", "requests ranked (once each, however often Serve asks again)", 0),
    (
        "kvmesh_router_rerankings_total",
        "rerankings",
        "rankings of a request again: Serve found no free replica, or the chosen one refused it",
        0,
    ),
    (
        "kvmesh_router_fallbacks_total",
        "fallbacks",
        "requests Serve placed elsewhere than the policy's first choice (a full replica or a slow probe)",
        0,
    ),
    (
        "kvmesh_router_decision_seconds_total",
        "decision_s_total",
        "time spent ranking (every ranking, re-rankings included)",
        0.0,
    ),
)


class ServingMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = _Counters()
        self.per_replica: dict[str, _Counters] = {}
        self._forgotten: dict[str, float] = {}  # replica -> when it was forgotten (time.monotonic), oldest first
        self.errors: dict[int, int] = {}
        self.stages: dict[str, list] = {}  # stage -> [seconds total, count]

    def record_stage(self, stage: str, seconds: float) -> None:
        """Add one request's time in `stage` (e.g. tokenize, engine_call): cumulative, cheap."""
        with self._lock:
            total = self.stages.setdefault(stage, [0.0, 0])
            total[0] += seconds
            total[1] += 1

    def record(
        self,
        replica: str | None,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        ttft_s: float | None,
        started: float | None = None,
    ) -> None:
        """One answered request. `replica` None counts it in the totals only (an answer no one replica made
        alone). `started` is `time.monotonic()` when it was sent: a replica forgotten since then gets no
        per-replica row back for it, however late it finishes; without `started`, a forgotten replica's
        requests count in the totals only."""
        with self._lock:
            self.total.add(prompt_tokens, cached_tokens, completion_tokens, ttft_s)
            if replica is None:
                return
            gone = self._forgotten.get(replica)
            if gone is not None and (started is None or started <= gone):
                return
            self.per_replica.setdefault(replica, _Counters()).add(
                prompt_tokens, cached_tokens, completion_tokens, ttft_s
            )

    def forget_replica(self, rid: str) -> None:
        """Drop a replica's per-replica counters once it left the fleet: with autoscaling every replica id
        ever seen would otherwise stay in /metrics. The totals keep what it served."""
        now = time.monotonic()
        with self._lock:
            self.per_replica.pop(rid, None)
            self._forgotten.pop(rid, None)
            self._forgotten[rid] = now
            while len(self._forgotten) > FORGOTTEN_MAX:
                del self._forgotten[next(iter(self._forgotten))]

    def record_error(self, status: int) -> None:
        with self._lock:
            self.errors[status] = self.errors.get(status, 0) + 1

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "total": self.total.as_dict(),
                "per_replica": {k: v.as_dict() for k, v in self.per_replica.items()},
                "errors": dict(self.errors),
                "stages": {k: {"seconds_total": v[0], "count": v[1]} for k, v in sorted(self.stages.items())},
            }

    def prometheus_text(self, ledger: dict | None = None, router: dict | None = None) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]):
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
                out.append(f"{name}{{{lab}}} {value}" if lab else f"{name} {value}")

        def histogram(name: str, help_text: str, groups: list[tuple[dict, _Counters]]) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} histogram")
            for labels, c in groups:
                base = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
                sep = "," if base else ""
                for b, n in zip(TTFT_BUCKETS, c.ttft_buckets):
                    out.append(f'{name}_bucket{{{base}{sep}le="{b}"}} {n}')
                out.append(f'{name}_bucket{{{base}{sep}le="+Inf"}} {c.ttft_count}')
                out.append(f"{name}_sum{{{base}}} {c.ttft_sum}")
                out.append(f"{name}_count{{{base}}} {c.ttft_count}")

        with self._lock:
            # the fleet's figures, then each engine replica's in a family of its own (kvmesh_replica_*)
            for prefix, groups in (
                ("kvmesh", [({}, self.total)]),
                ("kvmesh_replica", [({"replica": r}, c) for r, c in sorted(self.per_replica.items())]),
            ):
                each = " (per engine replica)" if prefix == "kvmesh_replica" else ""
                for name, kind, help_text, value in _FAMILIES:
                    metric(f"{prefix}_{name}", kind, f"{help_text}{each}", [(lab, value(c)) for lab, c in groups])
                histogram(
                    f"{prefix}_ttft_seconds",
                    f"time to first token: from the ingress's handler to the first output coming back{each}",
                    groups,
                )
            metric(
                "kvmesh_http_errors_total",
                "counter",
                "client/server errors by status",
                [({"status": str(s)}, n) for s, n in sorted(self.errors.items())],
            )
            stages = sorted(self.stages.items())
            metric(
                "kvmesh_ingress_stage_seconds_total",
                "counter",
                "seconds requests spent in each ingress stage",
                [({"stage": k}, v[0]) for k, v in stages],
            )
            metric(
                "kvmesh_ingress_stage_calls_total",
                "counter",
                "requests timed in each ingress stage",
                [({"stage": k}, v[1]) for k, v in stages],
            )
        if ledger is not None:
            per_replica = sorted(ledger["per_replica"].items())
            for column, (name, help_text, total) in enumerate(
                (
                    ("predicted_cached_tokens_total", "cached tokens the router predicted", "predicted_tokens"),
                    (
                        "delivered_cached_tokens_total",
                        "cached tokens the engines reported for requests with a prediction",
                        "delivered_tokens",
                    ),
                    (
                        "prediction_mismatches_total",
                        "requests where predicted and delivered cached tokens differ by a block or more",
                        "mismatches",
                    ),
                )
            ):
                metric(f"kvmesh_{name}", "counter", help_text, [({}, ledger[total])])
                metric(
                    f"kvmesh_replica_{name}",
                    "counter",
                    f"{help_text} (per engine replica)",
                    [({"replica": r}, v[column]) for r, v in per_replica],
                )
            metric("kvmesh_prediction_compared_total", "counter", "requests compared", [({}, ledger["compared"])])
            metric(
                "kvmesh_hash_contract_alarm",
                "gauge",
                "1 while predictions keep disagreeing with the engines "
                "(router and engine block hashes probably differ)",
                [({}, int(ledger["alarm"]))],
            )
        if router is not None:
            idx = router.get("index", {})
            metric(
                "kvmesh_router_index_events_total",
                "counter",
                "prefix-index counters",
                [({"counter": k}, v) for k, v in sorted(idx.items()) if k not in INDEX_GAUGES],
            )
            for key, (name, help_text) in INDEX_GAUGES.items():
                if key in idx:
                    metric(name, "gauge", help_text, [({}, idx[key])])
            for name, key, help_text, default in _ROUTER_COUNTERS:
                metric(name, "counter", help_text, [({}, router.get(key, default))])
            stats = router.get("routing_stats") or {}
            steps = _per_replica(stats, "steps")
            if steps:  # requests per step (rate over rate) is how much the engines batch
                metric(
                    "kvmesh_replica_engine_steps_total",
                    "counter",
                    "engine steps each replica has run, as of its last routing stats",
                    steps,
                )
            loaded = _per_replica(stats, "external_hit_tokens")
            if loaded:  # the delivered hits that came from the LMCache tiers (the rest: the engine's own cache)
                metric(
                    "kvmesh_replica_lmcache_loaded_tokens_total",
                    "counter",
                    "prompt tokens each replica loaded through LMCache, as of its last routing stats",
                    loaded,
                )
        return "\n".join(out) + "\n"
