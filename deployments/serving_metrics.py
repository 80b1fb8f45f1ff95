"""Ingress-side serving metrics in Prometheus text form: hit rates (token-weighted, and the mean over
requests of each one's cached share), the share of requests with any hit,
cached tokens, TTFT, predicted vs delivered cached tokens -- globally and per replica -- and the
time each request spends in the ingress's stages (sum of seconds and count per stage), so the
per-request overhead can be split without a profiler.

Why hand-rolled: a few counters and one histogram per replica; prometheus_client's global registry
would collide across Serve replicas sharing a process in tests, and we want `snapshot()` as plain data
for the demo and tests too.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A replica Serve stops finishes its streams after the router forgot it (5 s graceful shutdown for
# engines): for this long their requests count in the totals only, not in a new per-replica entry.
FORGOTTEN_HOLD_S = 60.0


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


class ServingMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = _Counters()
        self.per_replica: dict[str, _Counters] = {}
        self._forgotten: dict[str, float] = {}  # replica -> when it was forgotten (time.monotonic)
        self.errors: dict[int, int] = {}
        self.stages: dict[str, list] = {}  # stage -> [seconds total, count]

    def record_stage(self, stage: str, seconds: float) -> None:
        """Add one request's time in `stage` (e.g. tokenize, engine_call): cumulative, cheap."""
        with self._lock:
            total = self.stages.setdefault(stage, [0.0, 0])
            total[0] += seconds
            total[1] += 1

    def record(
        self, replica: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int, ttft_s: float | None
    ) -> None:
        with self._lock:
            self.total.add(prompt_tokens, cached_tokens, completion_tokens, ttft_s)
            gone = self._forgotten.get(replica)
            if gone is not None and time.monotonic() - gone < FORGOTTEN_HOLD_S:
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
            self._forgotten = {r: t for r, t in self._forgotten.items() if now - t < FORGOTTEN_HOLD_S}
            self._forgotten[rid] = now

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

        with self._lock:
            groups: list[tuple[dict, _Counters]] = [({}, self.total)]
            groups += [({"replica": r}, c) for r, c in sorted(self.per_replica.items())]
            metric(
                "kvmesh_requests_total",
                "counter",
                "completed generation requests",
                [(lab, c.requests) for lab, c in groups],
            )
            metric(
                "kvmesh_prompt_tokens_total", "counter", "prompt tokens", [(lab, c.prompt_tokens) for lab, c in groups]
            )
            metric(
                "kvmesh_cached_prompt_tokens_total",
                "counter",
                "prompt tokens served from the KV cache",
                [(lab, c.cached_tokens) for lab, c in groups],
            )
            metric(
                "kvmesh_completion_tokens_total",
                "counter",
                "generated tokens",
                [(lab, c.completion_tokens) for lab, c in groups],
            )
            metric(
                "kvmesh_hit_rate_tokens",
                "gauge",
                "token-weighted KV hit rate = cached / prompt tokens",
                [(lab, c.as_dict()["hit_rate_tokens"]) for lab, c in groups],
            )
            metric(
                "kvmesh_hit_rate_requests",
                "gauge",
                "mean over requests of cached / prompt tokens",
                [(lab, c.as_dict()["hit_rate_requests"]) for lab, c in groups],
            )
            metric(
                "kvmesh_requests_with_hit",
                "gauge",
                "fraction of requests with any cached prompt token",
                [(lab, c.as_dict()["requests_with_hit"]) for lab, c in groups],
            )
            out.append("# HELP kvmesh_ttft_seconds time to first token seen by the ingress")
            out.append("# TYPE kvmesh_ttft_seconds histogram")
            for labels, c in groups:
                base = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
                sep = "," if base else ""
                for b, n in zip(TTFT_BUCKETS, c.ttft_buckets):
                    out.append(f'kvmesh_ttft_seconds_bucket{{{base}{sep}le="{b}"}} {n}')
                out.append(f'kvmesh_ttft_seconds_bucket{{{base}{sep}le="+Inf"}} {c.ttft_count}')
                out.append(f"kvmesh_ttft_seconds_sum{{{base}}} {c.ttft_sum}")
                out.append(f"kvmesh_ttft_seconds_count{{{base}}} {c.ttft_count}")
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
            per_replica = ledger["per_replica"].items()
            metric(
                "kvmesh_predicted_cached_tokens_total",
                "counter",
                "cached tokens the router predicted",
                [({}, ledger["predicted_tokens"])] + [({"replica": r}, v[0]) for r, v in per_replica],
            )
            metric(
                "kvmesh_delivered_cached_tokens_total",
                "counter",
                "cached tokens the engines reported for requests with a prediction",
                [({}, ledger["delivered_tokens"])] + [({"replica": r}, v[1]) for r, v in per_replica],
            )
            metric(
                "kvmesh_prediction_mismatches_total",
                "counter",
                "requests where predicted and delivered cached tokens differ by a block or more",
                [({}, ledger["mismatches"])] + [({"replica": r}, v[2]) for r, v in per_replica],
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
                [({"counter": k}, v) for k, v in sorted(idx.items())],
            )
            metric("kvmesh_router_decisions_total", "counter", "routing decisions", [({}, router.get("decisions", 0))])
            metric(
                "kvmesh_router_fallbacks_total",
                "counter",
                "requests Serve placed elsewhere than the policy's first choice (a full replica or a slow probe)",
                [({}, router.get("fallbacks", 0))],
            )
            metric(
                "kvmesh_router_decision_seconds_total",
                "counter",
                "time spent deciding",
                [({}, router.get("decision_s_total", 0.0))],
            )
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
